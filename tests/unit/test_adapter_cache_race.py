"""The adapter caches' scans while another thread removes what they listed (the inference cache: a
concurrent pull's discard or eviction; the store: a delete or GC): an entry listed and gone before
its stat is skipped, not an INTERNAL error (CI saw `FileNotFoundError` in `make_room` when two loads
of one name raced a replace in the store)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from loraplex.services.inference import adapter_cache
from loraplex.services.inference.adapter_cache import AdapterCache


def _content_dir(root: Path, tag: str, size: int) -> Path:
    path = root / f"{tag * 64}-{'0' * 64}"
    path.mkdir(parents=True)
    (path / adapter_cache.WEIGHTS_FILE).write_bytes(b"x" * size)
    return path


def test_a_directory_removed_during_the_scan_is_skipped(tmp_path, monkeypatch):
    cache = AdapterCache(tmp_path, max_bytes=1000)
    old = _content_dir(tmp_path, "a", 400)
    gone = _content_dir(tmp_path, "b", 400)
    os.utime(old, (1, 1))  # the least recently used
    real_scandir = os.scandir

    def scandir_racing_a_discard(path=".", _real=real_scandir):
        if isinstance(path, int) or Path(path) != tmp_path:  # (rmtree scans by descriptor)
            return _real(path)
        entries = list(_real(path))
        if gone.exists():
            shutil.rmtree(gone)  # listed, then removed before make_room stats it
        return iter(entries)

    monkeypatch.setattr(adapter_cache.os, "scandir", scandir_racing_a_discard)
    # 400 bytes remain (the vanished 400 no longer count): 700 more need the old one evicted.
    assert cache.make_room(700, "new", in_use=set()) == [old.name]
    assert not old.exists() and not gone.exists()


def test_the_store_budget_scan_skips_a_blob_removed_during_it(tmp_path, monkeypatch):
    """The store's `BlobCache.total_bytes` under the same race (a delete or GC on another thread)."""
    from loraplex.adapter_store import blobs

    cache = blobs.BlobCache(tmp_path)
    kept, gone = cache.blob_dir / ("a" * 64), cache.blob_dir / ("b" * 64)
    kept.write_bytes(b"x" * 300)
    gone.write_bytes(b"x" * 500)
    real_scandir = os.scandir

    def scandir_racing_a_delete(path=".", _real=real_scandir):
        entries = list(_real(path))
        if Path(path) == cache.blob_dir and gone.exists():
            gone.unlink()
        return iter(entries)

    monkeypatch.setattr(blobs.os, "scandir", scandir_racing_a_delete)
    assert cache.total_bytes() == 300
