"""The inference side of the adapter store: resolve a name, pull it once, watch for deletes.

`fetch(name)` asks the store (`GetAdapter`), and unless the content is already in the local
cache (`<cache>/<weights hex>-<config hex>/`: an adapter is its weights *and* its config) and
hashes to the record's digests, streams `PullAdapter`: once its header tells the size, the pull
reserves its bytes under the cache's byte bound (adapter_cache.py; waiting while other pulls'
reservations leave no room) before writing any, checks the sha256 of both files against the
record and renames a finished temp dir into place, so a reader never sees a half-written adapter.
Concurrent fetches of one name share one pull (single flight).
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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from loraplex.services.inference.adapter_cache import (
    CARRIED_FILES,
    CONFIG_FILE,
    DISK_FULL_ERRNOS,
    WEIGHTS_FILE,
    AdapterCache,
    Reservation,
    carried_file_limit,
    default_max_bytes,
    read_carried_files,
    tokenizer_files_digest,
)
from loraplex.services.inference.errors import (
    AdapterIncompatible,
    AdapterInvalid,
    AdapterNotFound,
    BackendUnavailable,
    LoraplexError,
)
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


# A restarted store is found again within a second (grpc's default backoff grows to 2 min).
STORE_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
PULL_ATTEMPTS = 3
PULL_RETRY_S = 0.5
# How long a cold lookup waits for the store's connection before answering UNAVAILABLE.
CONNECT_WAIT_S = 3.0


@dataclass(eq=False)
class _Flight:
    future: asyncio.Future[PulledAdapter]
    joiners: int = 0  # callers waiting on it: each gets a hold of the directory


class PulledAdapter(NamedTuple):
    name: str
    path: Path
    record: pb.AdapterRecord


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS to the store when `ca` is given; `cert`/`key` are the client certificate for mutual TLS."""
    if not ca:
        return None
    pair = (Path(key).read_bytes(), Path(cert).read_bytes()) if cert and key else (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(), private_key=pair[0], certificate_chain=pair[1]
    )


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1] if ":" in digest else digest


def content_dir_name(weights_digest: str, config_digest: str, files_digest: str = "") -> str:
    """The cache directory of one adapter content: every digest, so the same weights under another
    adapter_config.json (another lora_alpha, rank_pattern, ...) or another chat template never
    share a copy."""
    name = f"{_hex(weights_digest)}-{_hex(config_digest)}"
    return f"{name}-{_hex(files_digest)}" if files_digest else name


def _map_rpc_error(err: grpc.RpcError, name: str, what: str) -> LoraplexError:
    code = err.code()
    detail = err.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFound(
            f"adapter {name!r} is not loaded here and not in the adapter store", adapter=name
        )
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        cls = AdapterInvalid if code == grpc.StatusCode.INVALID_ARGUMENT else AdapterIncompatible
        return cls(f"adapter store rejected {name!r}: {detail}", adapter=name)
    return BackendUnavailable(
        f"adapter store {what} for {name!r} failed ({code.name}): {detail}", adapter=name
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_pulls(cache_dir: Path) -> list[str]:
    """Drop what a killed server left: `.pull-<pid>-*` temp dirs of processes that are gone, and
    directories named by the weights digest alone (an older layout that ignored the config).
    Pulls of live servers sharing the directory are left alone."""
    removed = []
    for entry in cache_dir.iterdir():
        name = entry.name
        if name.startswith(".pull-"):
            pid = name.split("-")[1]
            if pid.isdecimal() and (int(pid) == os.getpid() or _alive(int(pid))):
                continue
        elif not (len(name) == 64 and all(c in "0123456789abcdef" for c in name)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("removed %d leftover pulls from %s", len(removed), cache_dir)
    return removed


def _header_files(name: str, header: pb.AdapterHeader, record: pb.AdapterRecord) -> dict[str, bytes]:
    """The tokenizer files of a PullAdapter header, checked: known names only (never a path), each
    once and bounded, hashing to the record's files_digest."""
    files: dict[str, bytes] = {}
    for f in header.files:
        if f.name not in CARRIED_FILES or f.name in files or len(f.content) > carried_file_limit(f.name):
            raise AdapterInvalid(
                f"adapter {name!r}: the store sent a file {f.name[:64]!r} ({len(f.content)} bytes) that is "
                f"not one of {', '.join(CARRIED_FILES)} within its bound (tokenizer.json "
                f"{carried_file_limit('tokenizer.json')} bytes, the others {carried_file_limit('')}), "
                "once each",
                adapter=name,
            )
        files[f.name] = f.content
    if tokenizer_files_digest(files) != record.files_digest:
        raise AdapterInvalid(f"adapter {name!r}: tokenizer files digest mismatch", adapter=name)
    return files


def _size(record: pb.AdapterRecord | None) -> str:
    return "(no header yet) size" if record is None else f"{record.size_bytes} bytes"


class StoreClient:
    """Talks to one adapter store at `target` (HOST:PORT); all methods are coroutines."""

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
        self.target = target
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_pulls(self.cache_dir)
        bound = cache_max_bytes if cache_max_bytes is not None else default_max_bytes(self.cache_dir)
        # the server sets `cache.in_use` once its engine is up
        self.cache = AdapterCache(self.cache_dir, bound)
        log.info("adapter cache %s bounded at %d bytes", self.cache_dir, bound)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=STORE_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=STORE_CHANNEL_OPTIONS)
        self._stub = pb_grpc.AdapterStoreStub(self._channel)
        self._inflight: dict[str, _Flight] = {}
        # Set (and replaced) whenever a pull gives back its cache reservation: pulls waiting for room.
        self._room_freed = asyncio.Event()
        self._on_pull = on_pull
        self.pulls = 0  # completed PullAdapter streams, for metrics and tests
        # Names the store has, kept by `watch` (listed once when it connects, then its events):
        # residency metrics read this instead of listing the whole store again and again.
        self.known_names: set[str] = set()
        # The store's admin token (its RegisterAdapter/DeleteAdapter need it), sent on every call.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def close(self) -> None:
        await self._channel.close()

    async def get(self, name: str, timeout: float = CONNECT_WAIT_S) -> pb.AdapterRecord:
        try:
            req = pb.GetAdapterRequest(name=name)
            # wait_for_ready rides out a reconnect instead of failing at once while it backs off
            return await self._stub.GetAdapter(
                req, timeout=timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as err:
            raise _map_rpc_error(err, name, "GetAdapter") from None

    async def register(
        self, name: str, source: str, revision: str = "", timeout: float = 600.0
    ) -> pb.AdapterRecord:
        try:
            req = pb.RegisterAdapterRequest(name=name, source=source, revision=revision)
            return await self._stub.RegisterAdapter(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise AdapterNotFound(
                    f"adapter source {source!r} not found: {err.details()}", adapter=name
                ) from None
            raise _map_rpc_error(err, name, "RegisterAdapter") from None

    async def delete(self, name: str, timeout: float = 30.0) -> bool:
        """Delete the adapter from the store (every replica drops it via WatchAdapters); False if
        the store had no such adapter."""
        try:
            req = pb.DeleteAdapterRequest(name=name)
            return (await self._stub.DeleteAdapter(req, timeout=timeout, metadata=self._metadata)).deleted
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise _map_rpc_error(err, name, "DeleteAdapter") from None

    async def list_page(self, page_size: int, after: str = "") -> tuple[list[pb.AdapterRecord], str]:
        """Up to `page_size` records named after `after`, in name order, and the next page's token."""
        try:
            req = pb.ListStoreAdaptersRequest(page_size=page_size, page_token=after)
            resp = await self._stub.ListAdapters(req, timeout=10.0, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _map_rpc_error(err, "*", "ListAdapters") from None
        return list(resp.adapters), resp.next_page_token

    async def list(self) -> list[pb.AdapterRecord]:
        out: list[pb.AdapterRecord] = []
        token = ""
        while True:
            page, token = await self.list_page(1000, token)
            out.extend(page)
            if not token:
                return out

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
                record, nbytes = await self._stream_into(name, tmp, book)
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

    async def _stream_into(
        self,
        name: str,
        tmp: Path,
        book: Callable[[pb.AdapterRecord, bytes, dict[str, bytes]], Awaitable[None]],
    ) -> tuple[pb.AdapterRecord, int]:
        """The pull's files into `tmp`; `book(record, config, tokenizer files)` runs once the header
        arrives, before anything is written."""
        record: pb.AdapterRecord | None = None
        weights = hashlib.sha256()
        nbytes = 0
        try:
            with open(tmp / WEIGHTS_FILE, "wb") as out:
                async for chunk in self._stub.PullAdapter(
                    pb.PullAdapterRequest(name=name), timeout=600.0, metadata=self._metadata
                ):
                    if chunk.WhichOneof("payload") == "header":
                        if record is not None:
                            raise BackendUnavailable(
                                f"adapter store sent a second header for {name!r}; pull abandoned",
                                adapter=name,
                            )
                        record = chunk.header.record
                        config = chunk.header.adapter_config_json.encode()
                        if record.config_digest and hashlib.sha256(config).hexdigest() != _hex(
                            record.config_digest
                        ):
                            raise AdapterInvalid(
                                f"adapter {name!r}: adapter_config.json digest mismatch", adapter=name
                            )
                        files = _header_files(name, chunk.header, record)
                        await book(record, config, files)
                        (tmp / CONFIG_FILE).write_bytes(config)
                        for file_name, data in files.items():
                            (tmp / file_name).write_bytes(data)
                    else:
                        # Counted as it arrives: a store (or whatever answers in its place) that sends
                        # more than the record says would otherwise fill this server's disk.
                        if record is None or nbytes + len(chunk.data) > record.size_bytes:
                            raise BackendUnavailable(
                                f"adapter store sent adapter {name!r} past the {_size(record)} its record "
                                "gives; pull abandoned",
                                adapter=name,
                            )
                        weights.update(chunk.data)
                        out.write(chunk.data)
                        nbytes += len(chunk.data)
                out.flush()
                os.fsync(out.fileno())
        except grpc.RpcError as err:
            raise _map_rpc_error(err, name, "PullAdapter") from None
        if record is None:
            raise BackendUnavailable(f"adapter store sent no header for {name!r}", adapter=name)
        if "sha256:" + weights.hexdigest() != record.digest and weights.hexdigest() != record.digest:
            raise BackendUnavailable(
                f"adapter {name!r}: pulled bytes hash to sha256:{weights.hexdigest()}, record says "
                f"{record.digest}",
                adapter=name,
            )
        return record, nbytes

    def open_watch(self, last_event_id: str) -> grpc.aio.UnaryStreamCall:
        """A WatchAdapters stream from `last_event_id` (store_watch.py follows it)."""
        req = pb.WatchAdaptersRequest(last_event_id=last_event_id)
        return self._stub.WatchAdapters(req, metadata=self._metadata)
