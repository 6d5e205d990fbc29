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


def _scandir_removing(listed: Path, victim: Path, remove):
    """`os.scandir` that, for `listed`, lists it first and then `remove`s `victim` before its entries
    are handed out (every other call, rmtree's by descriptor included, is the real one)."""
    real_scandir = os.scandir

    def scandir(path="."):
        if isinstance(path, int) or Path(path) != listed:
            return real_scandir(path)
        entries = list(real_scandir(path))
        if victim.exists():
            remove(victim)
        return iter(entries)

    return scandir


def test_a_directory_removed_during_the_scan_is_skipped(tmp_path, monkeypatch):
    cache = AdapterCache(tmp_path, max_bytes=1000)
    old = _content_dir(tmp_path, "a", 400)
    gone = _content_dir(tmp_path, "b", 400)
    os.utime(old, (1, 1))  # the least recently used
    # Listed, then removed (another pull's discard) before make_room stats it.
    monkeypatch.setattr(adapter_cache.os, "scandir", _scandir_removing(tmp_path, gone, shutil.rmtree))
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
    monkeypatch.setattr(blobs.os, "scandir", _scandir_removing(cache.blob_dir, gone, Path.unlink))
    assert cache.total_bytes() == 300
