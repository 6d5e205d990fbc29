"""Local adapter sources (a directory or a file:// URI) as the inference server checks them.

A source is read once the way the adapter store reads it (stripped, a file:// URI
percent-decoded), and what `--allowed-local-dirs` checks is the resolved path that is then
used or sent to the store; every adapter file in the directory is confined on its own.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from urllib.parse import unquote, urlparse

from loraplex.services.inference.errors import AdapterNotFound, InvalidRequest
from loraplex.services.inference.lora.adapter_files import (
    CONFIG_FILE,
    PICKLE_FILES,
    TEMPLATE_FILES,
    WEIGHTS_FILE,
)

# Every file a loader opens (or looks at) in an adapter directory, the chat template's included:
# each is confined on its own, since a symlinked file inside an allowed directory could point
# anywhere (a template symlinked to a secret would be rendered into prompts, and read back).
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, *PICKLE_FILES, *TEMPLATE_FILES)


def _local_text(source: str) -> str:
    """A local source the way the adapter store reads it: stripped, a file:// URI percent-decoded.
    Checks read this, never the raw string, so " /dir" or "file:///ok/%2E%2E/x" cannot slip by."""
    text = source.strip()
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequest(
                f"file:// URI with a remote host {parsed.netloc[:100]!r} is not supported", field="source"
            )
        text = unquote(parsed.path)
        if "\0" in text:  # %00: no path holds a NUL, and the OS calls refuse one with a ValueError
            raise InvalidRequest(f"source {source[:200]!r} decodes to a path with a NUL byte", field="source")
    return text


def looks_local(source: str) -> bool:
    """A filesystem path or file:// URI rather than a Hub reference (`org/repo`, `hf://...`)."""
    source = source.strip()
    if source.startswith("file://"):
        return True
    if "://" in source:
        return False
    if source.startswith(("/", ".", "~")):
        return True
    try:
        return Path(source).expanduser().exists()
    except OSError:  # too long to be a path here
        return False


def public_model_name(model_path: str) -> str:
    """The model as callers see it (GetModelInfo.model): a Hub id as given, a local directory by
    its last part, never the server's filesystem layout."""
    if looks_local(model_path):
        return PurePath(_local_text(model_path).rstrip("/")).name or "model"
    return model_path


def _resolve(path: Path, shown: str) -> Path:
    try:
        return path.expanduser().resolve()
    except (
        OSError,
        RuntimeError,
    ) as exc:  # a symlink loop (RuntimeError before Python 3.13), a name too long
        reason = "a symlink loop" if isinstance(exc, RuntimeError) else exc.strerror
        raise InvalidRequest(f"source {shown[:200]!r} cannot be resolved: {reason}", field="source") from None


def check_allowed(source: str, allowed_dirs: tuple[str, ...]) -> Path:
    """The resolved path of a local source; InvalidRequest if it, or any adapter file in it, escapes
    --allowed-local-dirs (symlinks and '..' are resolved first, so neither can lead out)."""
    path = _resolve(Path(_local_text(source)), source)
    if not allowed_dirs:
        return path
    roots = [Path(d).expanduser().resolve() for d in allowed_dirs]
    for candidate in (path, *(path / name for name in ADAPTER_FILES)):
        if candidate is not path and not os.path.lexists(candidate):
            continue
        real = _resolve(candidate, source) if candidate is not path else path
        if not any(real.is_relative_to(root) for root in roots):
            what = "source" if candidate is path else f"{candidate.name} of source"
            raise InvalidRequest(f"{what} {source[:200]!r} is outside --allowed-local-dirs", field="source")
    return path


def local_path(source: str, allowed_dirs: tuple[str, ...]) -> Path:
    """A local source (path or file:// URI) as a directory, checked against --allowed-local-dirs."""
    if source.startswith("hf://"):
        raise InvalidRequest(
            f"source {source!r} is a Hub reference; this server has no adapter store (--adapter-store none) "
            "to fetch it, so give a local directory",
            field="source",
        )
    path = check_allowed(source, allowed_dirs)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # e.g. a name longer than the filesystem allows
        raise InvalidRequest(
            f"source {source[:200]!r} is not a usable path: {exc.strerror}", field="source"
        ) from None
    if not is_dir:
        raise AdapterNotFound(f"adapter source {source!r} is not a directory on the server", field="source")
    return path
