"""The files of a local adapter directory, read as a hostile caller may have laid them out.

Every file is resolved (symlinks followed to the end) and confined to --allowed-local-dirs on
its own, not only through its directory; only regular files are read (a FIFO would block, a
device such as /dev/zero never ends, and `stat` says 0 bytes for both); the byte limit is
enforced while copying, not only from `stat`; and a copy stops when its caller goes away or
the store shuts down.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from loraplex.adapter_store.errors import InvalidArgument, PermissionDenied, Unavailable

COPY_CHUNK = 1 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class Stopped(Unavailable):
    """The copy was abandoned: its caller went away or the store is shutting down."""


def describe_kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_allowed(real: Path, allowed_dirs: tuple[Path, ...]) -> None:
    if allowed_dirs and not any(real == d or d in real.parents for d in allowed_dirs):
        raise InvalidArgument(
            f"local path {real} is outside --allowed-local-dirs ({', '.join(map(str, allowed_dirs))})",
            field="source",
        )


def resolve_file(path: Path, allowed_dirs: tuple[Path, ...]) -> tuple[Path, os.stat_result]:
    """The real path and stat of the regular file `path` names, confined to `allowed_dirs`."""
    try:
        real = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        raise InvalidArgument(f"{path} is missing or a dangling symlink", field=path.name) from None
    except PermissionError as e:
        raise PermissionDenied(f"the store cannot read {path}: {e.strerror}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidArgument(f"{path} is a symlink loop", field=path.name) from None
        raise InvalidArgument(f"{path} cannot be resolved: {e.strerror}", field=path.name) from None
    check_allowed(real, allowed_dirs)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(
            f"{path.name} is {describe_kind(st.st_mode)}, not a regular file", field=path.name
        )
    return real, st


def copy_regular_file(src: Path, dst: Path, limit: int, stop: Callable[[], bool] | None = None) -> int:
    """Copy the regular file `src` (already resolved) to `dst`; InvalidArgument past `limit` bytes,
    Stopped once `stop` is set. Returns the bytes copied."""
    # O_NONBLOCK: opening a FIFO swapped in since `resolve_file` must not wait for a writer;
    # O_NOFOLLOW: nor may a symlink swapped in for the resolved path be followed.
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidArgument(f"{src.name} is {describe_kind(mode)}, not a regular file", field=src.name)
        total = 0
        with open(dst, "wb") as out:
            while chunk := f.read(COPY_CHUNK):
                total += len(chunk)
                if total > limit:
                    raise InvalidArgument(
                        f"{src.name}: copying stopped past {limit} bytes (what --max-adapter-bytes leaves "
                        "for it)",
                        field="size_bytes",
                    )
                if stop is not None and stop():
                    raise Stopped("the registration was abandoned (caller gone or store shutting down)")
                out.write(chunk)
    return total
