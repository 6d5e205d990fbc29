"""Content-addressed disk cache: `blobs/sha256/<hex>` plus a `<hex>.json` sidecar per blob.

A blob appears only by rename of a complete, validated file, so a crash never leaves a half
blob visible. The sidecar lists every record that points at the blob; `--reindex` rebuilds
the Redis index from sidecars alone. Pins mark blobs being streamed: eviction skips them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def _hex(digest: str) -> str:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexdigest


class BlobCache:
    def __init__(self, root: Path):
        self.root = root
        self.blob_dir = root / "blobs" / "sha256"
        self.staging_root = root / "staging"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self._pins: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards pins and sidecar read-modify-write

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

    def sidecar_path(self, digest: str) -> Path:
        return self.blob_dir / (_hex(digest) + ".json")

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

    def remove(self, digest: str) -> None:
        self.remove_blob(digest)
        self.sidecar_path(digest).unlink(missing_ok=True)

    # -- sidecars ----------------------------------------------------------------------------
    def read_sidecar(self, digest: str) -> dict:
        try:
            return json.loads(self.sidecar_path(digest).read_text())
        except FileNotFoundError:
            return {"digest": digest, "records": {}}

    def update_sidecar(self, digest: str, change: Callable[[dict], None]) -> dict:
        """Read, change in place, write back atomically; an emptied sidecar is removed with its blob."""
        with self._lock:
            data = self.read_sidecar(digest)
            change(data)
            if not data["records"]:
                self.remove(digest)
                return data
            path = self.sidecar_path(digest)
            fd, tmp = tempfile.mkstemp(prefix=".sidecar-", dir=self.blob_dir)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return data

    def iter_sidecars(self) -> Iterator[dict]:
        for path in sorted(self.blob_dir.glob("*.json")):
            try:
                yield json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                log.warning("skipping unreadable sidecar %s: %s", path, e)

    # -- budget ------------------------------------------------------------------------------
    def total_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.blob_dir):
            if entry.is_file() and len(entry.name) == 64:
                total += entry.stat().st_size
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
