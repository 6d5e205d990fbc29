"""The store's core: register, get, list, delete, evict, reindex (no gRPC here); pulls are
adapter_pull.py's, the blocking fetch-and-check of a registration record_fetch.py's.

Blocking work (fetching, hashing, file moves) runs in worker threads; Redis calls are async.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from loraplex.adapter_store.adapter_pull import AdapterPulls, PullHandle
from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import NotFound, Unavailable
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.names import check_name, check_not_base_model
from loraplex.adapter_store.record_fetch import RecordFetcher
from loraplex.adapter_store.records import StoreRecord
from loraplex.adapter_store.source_fetcher import SourceFetcher
from loraplex.adapter_store.sources import parse_source
from loraplex.adapter_store.tokenizer_store import TokenizerFileStore
from loraplex.adapter_store.tokenizer_tidy import drop_stale_references, move_inline_files

log = logging.getLogger(__name__)


async def _run_to_end(coro):
    """Await `coro` to its end even when the caller is cancelled meanwhile (the cancellation is
    raised after): a commit's disk writes, Redis script and clean-up are never left half done."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class AdapterRegistry:
    def __init__(
        self,
        config: StoreConfig,
        index: AdapterIndex,
        blobs: BlobCache,
        fetcher: SourceFetcher,
        base: BaseModelShapes | None = None,
    ):
        self.config = config
        self.index = index
        self.blobs = blobs
        self.fetcher = fetcher
        self.tokenizer_files = TokenizerFileStore(blobs.root)
        self.records = RecordFetcher(fetcher, blobs, base)
        self.pulls = AdapterPulls(
            config, index, blobs, self.tokenizer_files, self.records, evict_if_needed=self.evict_if_needed
        )
        self._evict_lock = asyncio.Lock()

    def begin_shutdown(self) -> None:
        """Fetches in worker threads stop at their next chunk instead of holding the exit."""
        self.records.begin_shutdown()

    # -- register ----------------------------------------------------------------------------
    async def register(self, name: str, source: str, revision: str = "") -> StoreRecord:
        check_name(name)
        check_not_base_model(name, self.config.base_model)
        spec = parse_source(source, revision, self.config.allowed_local_dirs)
        resolved = await asyncio.to_thread(self.fetcher.resolve, spec)
        async with self.index.name_lock(name):
            existing = await self.index.get(name)
            if (
                existing is not None
                and existing.source == spec.canonical
                and existing.fingerprint == resolved.fingerprint
                and self.blobs.has(existing.digest)
            ):
                # Same content as registered (the usual case for concurrent registrations of one name).
                return existing
            start_generation = await self.index.generation(name)
            record = await self.records.fetch(name, resolved)
            # The files go to the tokenizer file store (one copy per distinct set), the record
            # names them by files_digest.
            files_json, record = (
                record.files_json,
                record.with_(generation=start_generation + 1, files_json=""),
            )
            if existing is not None:
                record = (
                    record.with_(created_at=existing.created_at)
                    if existing.content == record.content
                    else record
                )
            # Once begun, the writes and their clean-up run to the end even if the caller goes.
            outcome = await _run_to_end(self._commit(record, files_json, existing, start_generation))
            if isinstance(outcome, StoreRecord):
                return outcome  # another registration's, which stands
            generation = outcome
        log.info(
            "registered %s -> %s (%s, %d bytes, generation %d)",
            name,
            record.digest[:19],
            record.source,
            record.size_bytes,
            generation,
        )
        await self.evict_if_needed(keep=record.digest)
        return record

    async def _commit(
        self, record: StoreRecord, files_json: str, existing: StoreRecord | None, start_generation: int
    ) -> int | StoreRecord:
        """Store the tokenizer files, the record file and the index entry of a fetched `record`; drop
        what the name used before. The new generation, or the record that stands instead (a
        registration that won while our lock had expired)."""
        name = record.name
        if record.files_digest:
            await asyncio.to_thread(self.tokenizer_files.add, record.files_digest, name, files_json)
        await asyncio.to_thread(self._sidecar_add, record)
        try:
            generation = await self.index.commit(record, start_generation)
        except Exception:
            # Not indexed (Redis failed): do not let a later --reindex resurrect it.
            await asyncio.to_thread(self._sidecar_drop, record.digest, name, record.generation)
            await self._drop_files_unless_used(record.files_digest, name, existing)
            raise
        if generation < 0:
            # Our lock expired and another registration committed first: theirs stands.
            await asyncio.to_thread(self._sidecar_drop, record.digest, name, record.generation)
            current = await self.index.get(name)
            await self._drop_files_unless_used(record.files_digest, name, current)
            if current is None:
                raise Unavailable(f"registration of {name!r} raced with a delete; retry")
            return current
        if existing is not None and existing.digest != record.digest:
            await asyncio.to_thread(self._sidecar_drop, existing.digest, name, None)
        if existing is not None:
            await self._drop_files_unless_used(existing.files_digest, name, record)
        return generation

    async def _drop_files_unless_used(self, digest: str, name: str, standing: StoreRecord | None) -> None:
        """`name`'s reference to the tokenizer files `digest`, unless the record that stands for the
        name (`standing`) uses them; the files go with their last reference."""
        if digest and (standing is None or standing.files_digest != digest):
            await asyncio.to_thread(self.tokenizer_files.drop, digest, name)

    def _sidecar_add(self, record: StoreRecord) -> None:
        self.blobs.add_record(record.digest, record.name, record.to_json())

    def _sidecar_drop(self, digest: str, name: str, only_generation: int | None) -> None:
        self.blobs.drop_record(digest, name, only_generation)

    # -- read --------------------------------------------------------------------------------
    async def get(self, name: str) -> StoreRecord:
        check_name(name)
        record = await self.index.get(name)
        if record is None:
            raise NotFound(
                f"no adapter named {name!r} in the store; RegisterAdapter it first", name=name, field="name"
            )
        return record

    async def list(self, page_size: int, page_token: str) -> tuple[list[StoreRecord], str]:
        page_size = min(max(page_size or 100, 1), 1000)
        if page_token:
            check_name(page_token)
        return await self.index.list_page(page_size, page_token)

    # -- delete ------------------------------------------------------------------------------
    async def delete(self, name: str) -> bool:
        check_name(name)
        async with self.index.name_lock(name):
            digest = await _run_to_end(self._delete(name))
        if digest is None:
            return False
        log.info("deleted %s (%s)", name, digest[:19])
        return True

    async def _delete(self, name: str) -> str | None:
        """Remove the name from the index, then its record file and tokenizer-file reference; the
        weights digest it pointed at, or None."""
        out = await self.index.delete(name)
        if out is None:
            return None
        digest, _generation, files = out
        # The blob's record files answer "does another name still use it" without listing
        # every name in the index; the tokenizer files' references likewise.
        if not await asyncio.to_thread(self.blobs.drop_record, digest, name, None):
            await self.index.forget_digest(digest)
        await self._drop_files_unless_used(files, name, None)
        return digest

    # -- pull --------------------------------------------------------------------------------
    def open_pull(self, name: str) -> contextlib.AbstractAsyncContextManager[PullHandle]:
        """The record, its blob path and its tokenizer files; the blob pinned against eviction until
        the context exits (adapter_pull.py)."""
        return self.pulls.open(name)

    # -- eviction ----------------------------------------------------------------------------
    async def evict_if_needed(self, keep: str | None = None) -> list[str]:
        """Drop least-recently-used blobs (never pinned ones, never `keep`) until under budget."""
        evicted = []
        async with self._evict_lock:
            total = await asyncio.to_thread(self.blobs.total_bytes)
            if total <= self.config.cache_max_bytes:
                return evicted
            for digest in await self.index.lru_digests():
                if total <= self.config.cache_max_bytes:
                    break
                if digest == keep or self.blobs.is_pinned(digest) or not self.blobs.has(digest):
                    continue
                freed = await asyncio.to_thread(self.blobs.remove_blob, digest)
                total -= freed
                evicted.append(digest)
                log.info("evicted blob %s (%d bytes) to stay under --cache-max-bytes", digest[:19], freed)
        return evicted

    # -- reindex -----------------------------------------------------------------------------
    async def reindex(self) -> int:
        """Rebuild the index from the blobs' record files; return how many records were restored."""
        restored = 0
        for entry in await asyncio.to_thread(lambda: list(self.blobs.iter_records())):
            if await self.index.restore(StoreRecord.from_json(entry)):
                restored += 1
        log.info("reindex: restored %d records from record files", restored)
        return restored

    async def tidy_tokenizer_files(self) -> None:
        """At start: move older records' inline tokenizer files out of Redis, then drop references
        that no record stands for (tokenizer_tidy.py)."""
        await move_inline_files(self.index, self.blobs, self.tokenizer_files)
        await drop_stale_references(self.index, self.blobs, self.tokenizer_files)

    async def count_unindexed_sidecars(self) -> int:
        indexed = await self.index.names_by_digest()
        on_disk = await asyncio.to_thread(self.blobs.record_digests)
        return len(on_disk - indexed.keys())
