"""Content-addressed disk cache: `blobs/sha256/<hex>` plus one small record file per name that
points at the blob, `blobs/sha256/<hex>.records/<name>.json` (small: an adapter's own tokenizer
files are kept once per set, tokenizer_store.py, and the record names them by digest; a record
file of the older format still holds them until the store moves them out at start).

A blob appears only by rename of a complete, validated file, so a crash never leaves a half
blob visible. The record files are what `--reindex` rebuilds the Redis index from. One file per
(blob, name) keeps a registration's disk write the same size however many names share the blob
(a single sidecar listing every name was rewritten whole on each registration), and each blob has
its own lock, so writes for one blob never wait on another's. Pins mark blobs being streamed:
eviction skips them. Sidecars of the older one-file layout (`<hex>.json`) are split at start.

The same mechanism, under `tokenizer_files/sha256/`, keeps each distinct set of adapter tokenizer
files once (tokenizer_store.py): there a "record file" is a reference, and `add_record` with
`content` writes the blob and the reference under one lock, so a delete of the last reference cannot
remove the blob between the two.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def _hex(digest: str) -> str:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexdigest


class BlobCache:
    def __init__(self, root: Path, subdir: str = "blobs"):
        self.root = root
        self.blob_dir = root / subdir / "sha256"
        self.staging_root = root / "staging"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self._pins: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards pins and the per-digest lock table
        self._digest_locks: dict[str, list] = {}  # digest -> [lock, holders and waiters]
        self.split_legacy_sidecars()

    def clean_staging(self) -> None:
        """Drop leftovers of fetches a crash interrupted."""
        for entry in self.staging_root.iterdir():
            shutil.rmtree(entry, ignore_errors=True)

    @contextmanager
    def staging_dir(self) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.staging_root))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def path(self, digest: str) -> Path:
        return self.blob_dir / _hex(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put(self, src: Path, digest: str) -> Path:
        """Move the validated file `src` (same filesystem) into place; a blob already there wins."""
        dst = self.path(digest)
        if dst.exists():
            src.unlink(missing_ok=True)
            return dst
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(src, 0o444)
        os.replace(src, dst)
        return dst

    def remove_blob(self, digest: str) -> int:
        """Delete the blob (sidecar kept); return the bytes freed."""
        path = self.path(digest)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        return size

    # -- record files ------------------------------------------------------------------------
    def records_dir(self, digest: str) -> Path:
        return self.blob_dir / (_hex(digest) + ".records")

    @contextmanager
    def digest_lock(self, digest: str) -> Iterator[None]:
        """Serialise record writes and removal of one blob; other blobs are not held up. The lock
        lives only while someone holds or waits for it, so the table does not grow with the blobs."""
        with self._lock:
            entry = self._digest_locks.get(digest)
            if entry is None:
                entry = self._digest_locks[digest] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._digest_locks[digest]

    def add_record(self, digest: str, name: str, record: dict, content: bytes | None = None) -> None:
        """Write (or replace) the record file of `name` under the blob, atomically; with `content`,
        first write the blob from it unless it is there (both under the blob's lock)."""
        with self.digest_lock(digest):
            if content is not None and not self.has(digest):
                self._write_blob(digest, content)
            folder = self.records_dir(digest)
            folder.mkdir(exist_ok=True)
            self._write_json(folder, name + ".json", record)

    def drop_record(self, digest: str, name: str, only_generation: int | None = None) -> bool:
        """Remove `name`'s record under the blob (only at `only_generation` when given); a blob left
        with no record is removed. Returns whether the blob still has records."""
        with self.digest_lock(digest):
            folder = self.records_dir(digest)
            path = folder / (name + ".json")
            if only_generation is not None:
                try:
                    if json.loads(path.read_text()).get("generation") != only_generation:
                        return True
                except (FileNotFoundError, json.JSONDecodeError):
                    pass
            path.unlink(missing_ok=True)
            if self._has_records_locked(digest):
                return True
            self.remove(digest)
            return False

    def has_records(self, digest: str) -> bool:
        with self.digest_lock(digest):
            return self._has_records_locked(digest)

    def _has_records_locked(self, digest: str) -> bool:
        try:
            with os.scandir(self.records_dir(digest)) as entries:
                return any(e.name.endswith(".json") for e in entries)
        except FileNotFoundError:
            return False

    def remove(self, digest: str) -> None:
        self.remove_blob(digest)
        shutil.rmtree(self.records_dir(digest), ignore_errors=True)

    def iter_records(self) -> Iterator[dict]:
        """Every record file's content (digest order, then name order)."""
        for folder in sorted(self.blob_dir.glob("*.records")):
            for path in sorted(folder.glob("*.json")):
                try:
                    yield json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as e:
                    log.warning("skipping unreadable record file %s: %s", path, e)

    def record_digests(self) -> set[str]:
        """Digests that have at least one record file."""
        return {
            "sha256:" + folder.name.removesuffix(".records")
            for folder in self.blob_dir.glob("*.records")
            if any(folder.glob("*.json"))
        }

    def _write_blob(self, digest: str, content: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.blob_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o444)
            os.replace(tmp, self.path(digest))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _write_json(self, folder: Path, filename: str, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / filename)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def split_legacy_sidecars(self) -> int:
        """Turn each `<hex>.json` of the older layout into one record file per name."""
        split = 0
        for path in sorted(self.blob_dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                digest = data["digest"]
                for name, record in data.get("records", {}).items():
                    self.add_record(digest, name, record)
                    split += 1
            except (OSError, ValueError, KeyError) as e:
                log.warning("could not split legacy sidecar %s: %s", path, e)
                continue
            path.unlink()
        if split:
            log.info("split %d records out of legacy sidecars", split)
        return split

    # -- budget ------------------------------------------------------------------------------
    def total_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.blob_dir):
            if entry.is_file() and len(entry.name) == 64:
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    pass  # removed since the scan (a delete or GC on another thread): not stored
        return total

    @contextmanager
    def pinned(self, digest: str) -> Iterator[None]:
        with self._lock:
            self._pins[digest] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[digest] -= 1
                if self._pins[digest] <= 0:
                    del self._pins[digest]

    def is_pinned(self, digest: str) -> bool:
        with self._lock:
            return self._pins[digest] > 0
