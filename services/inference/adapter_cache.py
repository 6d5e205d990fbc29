"""The inference side's on-disk adapter cache: a byte bound, LRU eviction, checked hits.

One directory per adapter content, `<weights hex>-<config hex>/` under `--adapter-cache-dir`, or
`<weights hex>-<config hex>-<tokenizer files hex>/` for an adapter that ships tokenizer files
(its chat template and tokenizer: `CARRIED_FILES`, which the store carries in the PullAdapter header).
The cache holds at most `--adapter-cache-max-bytes` (default: half of what the directory's
filesystem had free at start, plus what the cache already held). A pull reserves its bytes
before it writes any (`reserve`, once the header tells its size): directories that no loaded
adapter uses are evicted least recently used first (a directory's mtime is its last use) until
what the cache holds plus every reservation fits, so pulls running at once cannot overshoot the
bound together. A directory handed to a caller that is loading it is held (`hold`, taken in the
same step as the pull's booking is released) and never evicted until the load ends. A pull that
fits only once another finishes, or a load ends, waits for that; an adapter that cannot fit even
so, or a write the disk refuses, is RESOURCE_EXHAUSTED naming the directory and the bound.
Reservations are this process's: servers sharing one directory each keep their own bound. A hit
is used only after its files hash to the digests the store recorded; a mismatch (a file
rewritten on disk) drops the directory and the adapter is pulled again.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.services.inference.errors import CapacityExceeded

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Tokenizer files an adapter may ship, as the store carries them (adapter_store/tokenizer_files.py):
# nothing else is written into a cached copy. lora/adapter_files.py reads the chat template from them,
# engine/adapter_tokenizers.py the adapter's own tokenizer.
CARRIED_FILES = (
    "chat_template.jinja",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "added_tokens.json",
)
MAX_CARRIED_FILE_BYTES = 4 * 2**20
MAX_CARRIED_TOKENIZER_JSON_BYTES = 16 * 2**20  # the store's bound (Llama 3's is 9 MB)


def carried_file_limit(name: str) -> int:
    return MAX_CARRIED_TOKENIZER_JSON_BYTES if name == "tokenizer.json" else MAX_CARRIED_FILE_BYTES


DEFAULT_FREE_SHARE = 0.5
_HEX = set("0123456789abcdef")
# A disk that refuses a write: full, over quota, or over the process's file size limit.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_content_dir_name(name: str) -> bool:
    parts = name.split("-")
    return len(parts) in (2, 3) and all(len(p) == 64 and set(p) <= _HEX for p in parts)


def tokenizer_files_digest(files: dict[str, bytes]) -> str:
    """ "sha256:<hex>" over each file's name and sha256, in name order ("" for none): the store's
    `files_digest`, computed the same way (adapter_store/tokenizer_files.py)."""
    if not files:
        return ""
    lines = "".join(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def read_carried_files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in CARRIED_FILES if (path / n).is_file()}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _digest(d: str) -> str:
    return d if d.startswith("sha256:") else "sha256:" + d


def default_max_bytes(root: Path, share: float = DEFAULT_FREE_SHARE) -> int:
    """`share` of the free space of `root`'s filesystem plus what the cache holds already (so a
    restart with a full cache keeps it)."""
    root.mkdir(parents=True, exist_ok=True)
    return int(shutil.disk_usage(root).free * share) + dir_bytes(root)


def dir_bytes(root: Path) -> int:
    total = 0
    for entry in os.scandir(root):
        if entry.is_dir() and is_content_dir_name(entry.name):
            total += _content_bytes(Path(entry.path))
    return total


def _content_bytes(path: Path) -> int:
    total = 0
    try:
        for f in os.scandir(path):
            if f.is_file():
                total += f.stat().st_size
    except FileNotFoundError:
        pass
    return total


@dataclass(eq=False)
class Reservation:
    """Bytes a pull in progress will write, and the content directory it will fill (never evicted
    while the pull runs)."""

    nbytes: int
    dir_name: str


class AdapterCache:
    """Blocking file work; the store client calls it from worker threads."""

    def __init__(self, root: Path, max_bytes: int, in_use: Callable[[], set[str]] = set) -> None:
        self.root = root
        self.max_bytes = max_bytes
        # names of content directories a loaded adapter may read again (host copy dropped)
        self.in_use = in_use
        self.evictions = 0
        self._stamp_lock = threading.Lock()  # touch runs on worker threads
        self._last_stamp = 0
        # One reservation at a time scans, evicts and books; `release` only takes the short lock.
        self._reserve_lock = threading.Lock()
        self._booked_lock = threading.Lock()
        self._reservations: set[Reservation] = set()
        # Directories handed to a caller that is loading them (`hold`): never evicted meanwhile.
        self._held: Counter[str] = Counter()

    def too_big(self, what: str, need: int) -> CapacityExceeded:
        return CapacityExceeded(
            f"{what} needs {need} bytes but the adapter cache {self.root} is bounded at {self.max_bytes} "
            "bytes (--adapter-cache-max-bytes), and what it holds is used by loaded adapters; raise the "
            "bound, unload adapters, or free space",
        )

    def disk_full(self, what: str, error: OSError) -> CapacityExceeded:
        return CapacityExceeded(
            f"{what}: the adapter cache {self.root} (bound {self.max_bytes} bytes, "
            f"--adapter-cache-max-bytes) could not be written: {os.strerror(error.errno or 0)}; free "
            "space on its disk or lower the bound",
        )

    def total_bytes(self) -> int:
        return dir_bytes(self.root)

    def verified(self, path: Path, weights_digest: str, config_digest: str, files_digest: str = "") -> bool:
        """Every file present and hashing to the recorded digests; a directory that fails is removed."""
        weights, config = path / WEIGHTS_FILE, path / CONFIG_FILE
        if not (weights.is_file() and config.is_file()):
            return False
        if (
            file_sha256(weights) == _digest(weights_digest)
            and file_sha256(config) == _digest(config_digest)
            and tokenizer_files_digest(read_carried_files(path)) == files_digest
        ):
            self.touch(path)
            return True
        log.warning("cached adapter %s does not hash to the store's digests; dropping it to pull again", path)
        shutil.rmtree(path, ignore_errors=True)
        return False

    def touch(self, path: Path) -> None:
        """Mark a content directory used now. The stamp comes from the fine clock and rises
        strictly: the kernel stamps files from its coarse clock (one tick, 1-4 ms), so an adapter
        pulled right after another's hit would tie with it and eviction would fall to name order."""
        with self._stamp_lock:
            stamp = max(time.time_ns(), self._last_stamp + 1)
            self._last_stamp = stamp
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # best effort: only the eviction order suffers

    def discard(self, dir_name: str, in_use: set[str]) -> bool:
        """Remove one content directory (its adapter was deleted) unless a loaded adapter uses it."""
        with self._booked_lock:
            held = dir_name in self._held
        if not is_content_dir_name(dir_name) or dir_name in in_use or held:
            return False
        shutil.rmtree(self.root / dir_name, ignore_errors=True)
        return True

    def reserved_bytes(self) -> int:
        with self._booked_lock:
            return sum(r.nbytes for r in self._reservations)

    def reserve(
        self, need: int, what: str, dir_name: str = "", in_use: set[str] | None = None
    ) -> Reservation | None:
        """Book `need` bytes for a pull into `dir_name`, evicting unused directories (never booked or
        held ones) until they fit beside what the cache holds and what other pulls booked. None:
        they fit only once a pull in progress releases its booking or a load its hold (wait for
        that, then ask again); CapacityExceeded if they cannot fit even with neither."""
        with self._reserve_lock:
            with self._booked_lock:
                booked, held = list(self._reservations), set(self._held)
            try:
                self.make_room(
                    need + sum(r.nbytes for r in booked),
                    what,
                    keep={dir_name, *(r.dir_name for r in booked), *held},
                    in_use=in_use,
                )
            except CapacityExceeded:
                if need > self.max_bytes or not (booked or held):
                    raise self.too_big(what, need) from None
                return None
            reservation = Reservation(need, dir_name)
            with self._booked_lock:
                self._reservations.add(reservation)
            return reservation

    def release(self, reservation: Reservation, hold: str = "") -> None:
        """The pull finished (its directory now counts on disk) or failed (nothing of it stays).
        `hold`: the finished directory, held in the same step, so no eviction sees it unprotected."""
        with self._booked_lock:
            self._reservations.discard(reservation)
            if hold:
                self._held[hold] += 1

    def hold(self, dir_name: str, times: int = 1) -> None:
        """Keep `dir_name` from eviction until as many `unhold`s: a caller is about to load it."""
        if times > 0:
            with self._booked_lock:
                self._held[dir_name] += times

    def unhold(self, dir_name: str) -> None:
        with self._booked_lock:
            self._held[dir_name] -= 1
            if self._held[dir_name] <= 0:
                del self._held[dir_name]

    def make_room(
        self, need: int, what: str, keep: str | set[str] = "", in_use: set[str] | None = None
    ) -> list[str]:
        """Evict unused directories (never those named in `keep`), least recently used first, until
        `need` more bytes fit under the bound; CapacityExceeded if they cannot. `in_use`:
        `self.in_use()` taken by the caller (on the event loop, where the engine is asked), else
        asked here."""
        if need > self.max_bytes:
            raise self.too_big(what, need)
        dirs = []
        total = 0
        for entry in os.scandir(self.root):
            if entry.is_dir() and is_content_dir_name(entry.name):
                try:
                    used_ns = entry.stat().st_mtime_ns  # its last use (see touch)
                except FileNotFoundError:
                    continue  # removed since the scan by a concurrent pull's discard or eviction
                size = _content_bytes(Path(entry.path))
                total += size
                dirs.append((used_ns, entry.name, size))
        if total + need <= self.max_bytes:
            return []
        used = (self.in_use() if in_use is None else in_use) | ({keep} if isinstance(keep, str) else keep)
        evicted = []
        for _used_ns, name, size in sorted(dirs):
            if total + need <= self.max_bytes:
                break
            if name in used:
                continue
            shutil.rmtree(self.root / name, ignore_errors=True)
            total -= size
            evicted.append(name)
            self.evictions += 1
        if evicted:
            log.info(
                "adapter cache: evicted %d unused adapters (bound %d bytes)", len(evicted), self.max_bytes
            )
        if total + need > self.max_bytes:
            raise self.too_big(what, need)
        return evicted
