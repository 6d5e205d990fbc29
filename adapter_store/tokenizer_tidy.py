"""At start, bring the tokenizer file sets in line with the records (tokenizer_store.py).

- Records of the older format hold their tokenizer files inline, in Redis and in their record file:
  each set is moved into the set store, then the inline copies dropped (the record file first,
  Redis last, under the name's lock), so an upgraded store's Redis sheds the megabytes.
- A store killed between writing a name's reference and committing its record, or between a
  delete's index entry and its reference, leaves a reference no record stands for; it would keep
  its set forever. Such a reference is dropped when the name's record names other files, or when
  the name has no record in Redis and no record file naming that set (a record file that outlived
  Redis keeps its set for `--reindex`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.tokenizer_files import decode, files_digest
from loraplex.adapter_store.tokenizer_store import TokenizerFileStore

log = logging.getLogger(__name__)


async def move_inline_files(index: AdapterIndex, blobs: BlobCache, sets: TokenizerFileStore) -> int:
    """Move older records' inline tokenizer files into the set store; how many moved."""
    moved = 0
    for name in await index.names_with_inline_files():
        async with index.name_lock(name):
            record = await index.get(name, with_files=True)
            if record is None or not record.files_json:
                continue
            if files_digest(decode(record.files_json)) != record.files_digest:
                log.error("%s: its inline tokenizer files do not hash to its files_digest; left inline", name)
                continue
            await asyncio.to_thread(sets.add, record.files_digest, name, record.files_json)
            slim = record.with_(files_json="")
            await asyncio.to_thread(blobs.add_record, slim.digest, name, slim.to_json())
            moved += await index.drop_inline_files(name, record.generation, record.files_digest)
    if moved:
        log.info("moved the inline tokenizer files of %d records into the tokenizer file store", moved)
    return moved


def _record_file_names_set(blobs: BlobCache, name: str, digest: str) -> bool:
    """Whether some record file of `name` (under any weights blob) names the set `digest`."""
    for path in blobs.blob_dir.glob(f"*.records/{name}.json"):
        try:
            if json.loads(path.read_text()).get("files_digest") == digest:
                return True
        except (OSError, ValueError):
            continue
    return False


async def drop_stale_references(index: AdapterIndex, blobs: BlobCache, sets: TokenizerFileStore) -> int:
    """Drop references no record stands for (the module's docstring says which); how many."""
    refs = await asyncio.to_thread(lambda: list(sets.references()))
    if not refs:
        return 0
    indexed = await index.files_digests(sorted({name for _digest, name in refs}))
    dropped = 0
    for digest, name in refs:
        standing = indexed[name]
        if standing == digest:
            continue
        if standing is None and await asyncio.to_thread(_record_file_names_set, blobs, name, digest):
            continue
        async with index.name_lock(name):
            current = (await index.files_digests([name]))[name]
            if current != digest and (current is not None or not _record_file_names_set(blobs, name, digest)):
                await asyncio.to_thread(sets.drop, digest, name)
                dropped += 1
    if dropped:
        log.info("dropped %d tokenizer-file references no record stands for", dropped)
    return dropped
