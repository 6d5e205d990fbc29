"""PullAdapter's side of the registry: a record with its blob pinned against eviction and its
tokenizer files; a blob evicted (or files lost) meanwhile is fetched again from the recorded source
and revision, and must come back with the same digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

from redis.exceptions import RedisError

from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import FailedPrecondition, NotFound, Unavailable
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.names import check_name
from loraplex.adapter_store.record_fetch import RecordFetcher
from loraplex.adapter_store.records import StoreRecord
from loraplex.adapter_store.sources import parse_source
from loraplex.adapter_store.tokenizer_files import decode
from loraplex.adapter_store.tokenizer_store import TokenizerFileStore

log = logging.getLogger(__name__)


class PullHandle(NamedTuple):
    record: StoreRecord
    path: Path
    files: dict[str, bytes]  # its tokenizer files (name -> bytes), {} for none


class AdapterPulls:
    """Opens pulls for the registry (registry.py `open_pull`), which owns the parts it is given."""

    def __init__(
        self,
        config: StoreConfig,
        index: AdapterIndex,
        blobs: BlobCache,
        tokenizer_files: TokenizerFileStore,
        records: RecordFetcher,
        evict_if_needed: Callable[[str], Awaitable[list[str]]],
    ):
        self.config = config
        self.index = index
        self.blobs = blobs
        self.tokenizer_files = tokenizer_files
        self.records = records
        self._evict_if_needed = evict_if_needed

    @contextlib.asynccontextmanager
    async def open(self, name: str) -> AsyncIterator[PullHandle]:
        """The record, its blob path and its tokenizer files; the blob pinned against eviction until
        the context exits."""
        check_name(name)
        record = await self.index.get(name, with_files=True)
        if record is None:
            raise NotFound(
                f"no adapter named {name!r} in the store; RegisterAdapter it first", name=name, field="name"
            )
        with self.blobs.pinned(record.digest):
            files = await self._files_of(record)
            if not self.blobs.has(record.digest) or files is None:
                record = await self._refetch(record)
                files = await self._files_of(record)
            record = record.with_(last_used_at=await self._touch(name, record.digest, record.last_used_at))
            yield PullHandle(record, self.blobs.path(record.digest), files or {})

    async def _files_of(self, record: StoreRecord) -> dict[str, bytes] | None:
        """The record's tokenizer files: inline (a record of the older format, not yet moved) or from
        the tokenizer file store; None when the store has lost them."""
        if record.files_json or not record.files_digest:
            return decode(record.files_json)
        return await asyncio.to_thread(self.tokenizer_files.read, record.files_digest)

    async def _touch(self, name: str, digest: str, before: float) -> float:
        """Record the use for the LRU. Best effort: a Redis that refuses writes (its disk full, a
        read-only replica) must not fail a read; the blob is then only a little older to eviction."""
        try:
            return await self.index.touch(name, digest)
        except RedisError as e:
            log.warning("could not record the use of %s for eviction order (%s); pull continues", name, e)
            return before

    async def _refetch(self, record: StoreRecord) -> StoreRecord:
        """The blob was evicted (or its tokenizer files lost): fetch the same source at the recorded
        revision, same digests required."""
        async with self.index.name_lock(record.name):
            current = await self.index.get(record.name)
            if current is None:
                raise NotFound(
                    f"{record.name!r} was deleted while it was pulled", name=record.name, field="name"
                )
            if current.generation != record.generation:
                # Registered again meanwhile (its old tokenizer files may be gone with it).
                raise Unavailable(f"{record.name!r} was registered again while it was pulled; pull it again")
            if self.blobs.has(record.digest) and await self._files_of(record) is not None:
                return record
            spec = parse_source(record.source, record.revision, self.config.allowed_local_dirs)
            resolved = await asyncio.to_thread(self.records.fetcher.resolve, spec)
            again = await self.records.fetch(record.name, resolved)
            changed = [
                f"{what} {now[:19]} != {was[:19]}"
                for what, now, was in (
                    ("weights", again.digest, record.digest),
                    ("tokenizer files", again.files_digest, record.files_digest),
                )
                if now != was
            ]
            if changed:
                if not await asyncio.to_thread(self.blobs.has_records, again.digest):
                    await asyncio.to_thread(self.blobs.remove_blob, again.digest)
                raise FailedPrecondition(
                    f"{record.name!r} was evicted from the cache and its source {record.source} now has "
                    f"different content ({', '.join(changed)}); RegisterAdapter it again",
                    name=record.name,
                )
            if again.files_digest and not record.files_json:
                await asyncio.to_thread(
                    self.tokenizer_files.add, again.files_digest, record.name, again.files_json
                )
            log.info("re-fetched evicted %s", record.name)
        await self._evict_if_needed(record.digest)
        return record
