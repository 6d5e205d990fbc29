"""The inference side of the adapter store: resolve a name, pull it once into the local cache.

`StoreClient` is the store's calls (store_rpc.py) plus the local cache of pulled adapters.
`fetch(name)` asks the store (`GetAdapter`), and unless the content is already in the local
cache (`<cache>/<weights hex>-<config hex>/`: an adapter is its weights *and* its config) and
hashes to the record's digests, streams `PullAdapter` (store_pull.py): once its header tells
the size, the pull reserves its bytes under the cache's byte bound (adapter_cache.py; waiting
while other pulls' reservations leave no room) before writing any, checks the sha256 of both
files against the record and renames a finished temp dir into place, so a reader never sees a
half-written adapter. Concurrent fetches of one name share one pull (single flight).
`open_watch` starts a `WatchAdapters` stream; store_watch.py follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from loraplex.services.inference.adapter_cache import (
    CONFIG_FILE,
    DISK_FULL_ERRNOS,
    WEIGHTS_FILE,
    AdapterCache,
    Reservation,
    default_max_bytes,
    read_carried_files,
    tokenizer_files_digest,
)
from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.store_pull import content_dir_name, remove_stale_pulls, stream_into
from loraplex.services.inference.store_rpc import StoreConnection
from loraplex.v1 import adapter_store_pb2 as pb

log = logging.getLogger(__name__)


PULL_ATTEMPTS = 3
PULL_RETRY_S = 0.5


@dataclass(eq=False)
class _Flight:
    future: asyncio.Future[PulledAdapter]
    joiners: int = 0  # callers waiting on it: each gets a hold of the directory


class PulledAdapter(NamedTuple):
    name: str
    path: Path
    record: pb.AdapterRecord


class StoreClient(StoreConnection):
    """Talks to one adapter store at `target` (HOST:PORT) and keeps what it pulls under
    `cache_dir`; all methods are coroutines."""

    def __init__(
        self,
        target: str,
        cache_dir: Path,
        *,
        on_pull: Callable[[int], None] | None = None,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        cache_max_bytes: int | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_pulls(self.cache_dir)
        bound = cache_max_bytes if cache_max_bytes is not None else default_max_bytes(self.cache_dir)
        # the server sets `cache.in_use` once its engine is up
        self.cache = AdapterCache(self.cache_dir, bound)
        log.info("adapter cache %s bounded at %d bytes", self.cache_dir, bound)
        super().__init__(target, token=token, credentials=credentials)
        self._inflight: dict[str, _Flight] = {}
        # Set (and replaced) whenever a pull gives back its cache reservation: pulls waiting for room.
        self._room_freed = asyncio.Event()
        self._on_pull = on_pull
        self.pulls = 0  # completed PullAdapter streams, for metrics and tests
        # Names the store has, kept by `watch` (listed once when it connects, then its events):
        # residency metrics read this instead of listing the whole store again and again.
        self.known_names: set[str] = set()

    async def fetch(self, name: str) -> PulledAdapter:
        """The adapter's local directory, pulling it from the store if needed (one pull per name at a
        time). Not held: a caller about to load it uses `held`."""
        async with self.held(name) as pulled:
            return pulled

    @contextlib.asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[PulledAdapter]:
        """`fetch`, the directory kept from eviction until the block exits (from before a pull gives
        back its booking): a pull waiting for room cannot take it while the engine reads it."""
        pulled = await self._fetch_held(name)
        try:
            yield pulled
        finally:
            self._unhold(pulled.path.name)

    async def _fetch_held(self, name: str) -> PulledAdapter:
        """One fetch per name at a time; each caller returns holding the directory once."""
        flight = self._inflight.get(name)
        if flight is not None:
            flight.joiners += 1
            try:
                return await asyncio.shield(flight.future)
            except asyncio.CancelledError:
                if not flight.future.done():
                    flight.joiners -= 1  # no hold is taken for this caller
                elif not flight.future.cancelled() and flight.future.exception() is None:
                    self._unhold(flight.future.result().path.name)  # taken for it: give it back
                raise
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._inflight[name] = flight
        try:
            result = await self._fetch(name)  # held once, for this caller
            self.cache.hold(result.path.name, flight.joiners)
            flight.future.set_result(result)
            return result
        except BaseException as exc:
            flight.future.set_exception(exc)
            flight.future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            self._inflight.pop(name, None)

    async def _fetch(self, name: str) -> PulledAdapter:
        record = await self.get(name)
        self.known_names.add(name)  # a resync then sees it go even if no event about it arrived
        # A record without a config digest (an older store) cannot name its content: always pull.
        local = (
            self.cache_dir / content_dir_name(record.digest, record.config_digest, record.files_digest)
            if record.config_digest
            else None
        )
        if local is not None and await asyncio.to_thread(
            self.cache.verified, local, record.digest, record.config_digest, record.files_digest
        ):
            self.cache.hold(local.name)
            return PulledAdapter(name, local, record)
        if record.size_bytes > self.cache.max_bytes:  # no pull for what can never fit
            raise self.cache.too_big(f"adapter {name!r}", record.size_bytes)
        # A stream cut halfway or bytes that do not hash to the record are retried from the
        # start; the partial copy is never renamed into the cache, so no half adapter is loaded.
        for attempt in range(1, PULL_ATTEMPTS + 1):
            try:
                return await self._pull(name)
            except BackendUnavailable as exc:
                if attempt == PULL_ATTEMPTS:
                    raise
                log.warning(
                    "pull of %s failed (attempt %d/%d): %s; retrying",
                    name,
                    attempt,
                    PULL_ATTEMPTS,
                    exc.message,
                )
                await asyncio.sleep(PULL_RETRY_S * attempt)
        raise AssertionError("unreachable")

    async def _reserve(self, name: str, need: int, dir_name: str) -> Reservation:
        """Book `need` bytes of the cache, waiting while other pulls' bookings leave no room."""
        while True:
            freed = self._room_freed  # taken first: a release during the attempt wakes the wait
            what, in_use = f"adapter {name!r}", self.cache.in_use()
            attempt = asyncio.ensure_future(
                asyncio.to_thread(self.cache.reserve, need, what, dir_name, in_use)
            )
            try:
                reservation = await asyncio.shield(attempt)
            except asyncio.CancelledError:
                attempt.add_done_callback(self._release_abandoned)  # booked for a caller that left
                raise
            if reservation is not None:
                return reservation
            await freed.wait()

    def _release_abandoned(self, attempt: asyncio.Future) -> None:
        if not attempt.cancelled() and attempt.exception() is None and attempt.result() is not None:
            self._release(attempt.result())

    def _release(self, reservation: Reservation, hold: str = "") -> None:
        self.cache.release(reservation, hold)
        self._room_freed.set()
        self._room_freed = asyncio.Event()

    def _unhold(self, dir_name: str) -> None:
        self.cache.unhold(dir_name)
        self._room_freed.set()
        self._room_freed = asyncio.Event()

    async def _pull(self, name: str) -> PulledAdapter:
        tmp = Path(tempfile.mkdtemp(prefix=f".pull-{os.getpid()}-", dir=self.cache_dir))
        reservation: Reservation | None = None
        done = ""  # the finished directory: held as the booking goes

        async def book(record: pb.AdapterRecord, config: bytes, files: dict[str, bytes]) -> None:
            nonlocal reservation
            config_hex, files_digest = hashlib.sha256(config).hexdigest(), tokenizer_files_digest(files)
            dir_name = content_dir_name(record.digest, config_hex, files_digest)
            need = record.size_bytes + len(config) + sum(map(len, files.values()))
            reservation = await self._reserve(name, need, dir_name)

        try:
            try:
                record, nbytes = await stream_into(self.pull_stream, name, tmp, book)
            except OSError as err:
                if err.errno in DISK_FULL_ERRNOS:
                    raise self.cache.disk_full(f"adapter {name!r}", err) from None
                raise
            config_digest = "sha256:" + hashlib.sha256((tmp / CONFIG_FILE).read_bytes()).hexdigest()
            files_digest = tokenizer_files_digest(read_carried_files(tmp))
            target = self.cache_dir / content_dir_name(record.digest, config_digest, files_digest)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / WEIGHTS_FILE).exists():  # lost a race with a complete copy: fine
                    raise
            self.cache.touch(target)  # its last use, on the same clock as the hits' (see touch)
            self.pulls += 1
            if self._on_pull is not None:
                self._on_pull(nbytes)
            log.info("pulled adapter %s (%s, %d bytes) into %s", name, record.digest, nbytes, target)
            done = target.name
            return PulledAdapter(name, target, record)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if reservation is not None:  # after the rename: its bytes now count on disk
                self._release(reservation, done)
            elif done:
                self.cache.hold(done)
