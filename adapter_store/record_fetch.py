"""The blocking half of a registration: fetch a resolved source, check it (config, tokenizer files,
weights against the base model), put its weights in the blob cache and make its StoreRecord.

It runs on a worker thread that stops at its next chunk when its caller goes (the RPC cancelled) or
the store shuts down; the registry (registry.py) commits what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.lora_config import parse_lora_config
from loraplex.adapter_store.records import StoreRecord
from loraplex.adapter_store.source_fetcher import SourceFetcher
from loraplex.adapter_store.sources import ResolvedSource
from loraplex.adapter_store.tokenizer_files import check_file, check_vocabulary, encode, files_digest
from loraplex.adapter_store.validate import validate_adapter

log = logging.getLogger(__name__)


class RecordFetcher:
    """A resolved source -> its weights blob stored and its StoreRecord (not yet indexed)."""

    def __init__(self, fetcher: SourceFetcher, blobs: BlobCache, base: BaseModelShapes | None = None):
        self.fetcher = fetcher
        self.blobs = blobs
        self.base = base
        self.fetch_count = 0  # fetches actually run (not answered from the index)
        self._stopping = threading.Event()

    def begin_shutdown(self) -> None:
        """Fetches in worker threads stop at their next chunk instead of holding the exit."""
        self._stopping.set()

    async def fetch(self, name: str, resolved: ResolvedSource) -> StoreRecord:
        """Fetch and validate off the event loop; a caller that goes away (its RPC cancelled)
        stops the copy too, rather than leaving a thread writing for nobody."""
        gone = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(
                self._fetch_validate_store, name, resolved, lambda: gone.is_set() or self._stopping.is_set()
            )
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            gone.set()
            work.add_done_callback(lambda w, n=name: self._abandoned(w, n))
            raise

    def _abandoned(self, work: asyncio.Future, name: str) -> None:
        error = None if work.cancelled() else work.exception()
        if error is not None:
            log.info("fetch for %s abandoned by its caller: %s", name, error)
            return
        if not work.cancelled():
            # It finished first: a blob no record points at would never be evicted.
            digest = work.result().digest
            if not self.blobs.has_records(digest):
                self.blobs.remove_blob(digest)
        log.info("fetch for %s abandoned by its caller after it finished", name)

    def _fetch_validate_store(
        self, name: str, resolved: ResolvedSource, stop: Callable[[], bool] | None = None
    ) -> StoreRecord:
        self.fetch_count += 1
        spec = resolved.spec
        log.info(
            "fetching %s for %s",
            spec.canonical + (f"@{resolved.revision[:12]}" if resolved.revision else ""),
            name,
        )
        with self.blobs.staging_dir() as staging:
            fetched = self.fetcher.fetch(resolved, staging, stop)
            config = parse_lora_config(fetched.config_raw)
            tokenizer_texts = {n: check_file(n, data) for n, data in fetched.tokenizer_files.items()}
            check_vocabulary(tokenizer_texts, self.base)
            summary = validate_adapter(config, fetched.weights, self.base)
            self.blobs.put(fetched.weights, summary.digest)
        now = time.time()
        return StoreRecord(
            name=name,
            source=spec.canonical,
            revision=fetched.revision,
            digest=summary.digest,
            base_model=config.base_model,
            rank=summary.rank,
            alpha=config.lora_alpha,
            target_modules=tuple(config.target_module_names()),
            use_rslora=config.use_rslora,
            dtype=summary.dtype,
            size_bytes=summary.size_bytes,
            created_at=now,
            last_used_at=now,
            config_digest=config.digest,
            config_json=config.text,
            requested_revision=spec.revision,
            fingerprint=resolved.fingerprint,
            files_json=encode(tokenizer_texts),
            files_digest=files_digest(fetched.tokenizer_files),
        )
