"""Adapter sources: what a caller names, parsed (SourceSpec), what it resolves to (ResolvedSource) and
what is fetched (FetchedAdapter); and the two checks every kind of source applies to its files.

Accepted sources:
- `hf://org/repo`, `hf://org/repo@rev`, `org/repo` — a Hugging Face Hub model repo
  (revision = branch, tag or commit; HF_TOKEN / HF_ENDPOINT honoured);
- `file:///abs/dir`, `/abs/dir`, `./dir`, `~/dir` — a local PEFT adapter directory.
Only `adapter_config.json` and `adapter_model.safetensors` (or, with --allow-pickle,
`adapter_model.bin`) are read, and the small tokenizer files of tokenizer_files.py when present.
Resolving and fetching are source_fetcher.py's (the Hub's side: hub_source.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlparse

from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.local_files import check_allowed
from loraplex.adapter_store.pickle_convert import PICKLE_FILE
from loraplex.adapter_store.validate import WEIGHTS_FILE

REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
REVISION_RE = re.compile(r"^[A-Za-z0-9._/-]{1,256}$")
MAX_SOURCE_CHARS = 4096


class SourceSpec(NamedTuple):
    kind: str  # "hub" or "local"
    location: str  # repo id, or the absolute real path of the directory
    revision: str  # requested revision ("" = default branch; always "" for local)
    canonical: str  # what the record stores: hf://org/repo or file:///abs/dir


class ResolvedSource(NamedTuple):
    spec: SourceSpec
    revision: str  # Hub commit sha, "" for local
    # Changes whenever the content may have changed: the commit for the Hub, sizes+mtimes locally.
    fingerprint: str
    weights_file: str  # WEIGHTS_FILE or PICKLE_FILE
    tokenizer_files: tuple[str, ...] = ()  # those of CARRIED_FILES the source has


class FetchedAdapter(NamedTuple):
    config_raw: bytes
    weights: Path  # a safetensors file inside the staging dir
    revision: str
    tokenizer_files: dict[str, bytes]  # unchecked: record_fetch.py checks them with the rest


def parse_source(source: str, revision: str, allowed_dirs: tuple[Path, ...] = ()) -> SourceSpec:
    if len(source) > MAX_SOURCE_CHARS or "\0" in source:
        raise InvalidArgument(
            f"source is longer than {MAX_SOURCE_CHARS} characters or has a NUL", field="source"
        )
    if len(revision) > 256:
        raise InvalidArgument("revision is longer than 256 characters", field="revision")
    source = source.strip()
    if not source:
        raise InvalidArgument(
            "source is empty: give hf://org/repo[@rev], org/repo or a local directory", field="source"
        )
    if source.startswith("hf://"):
        repo, _, at_rev = source[len("hf://") :].partition("@")
        if at_rev and revision and at_rev != revision:
            raise InvalidArgument(
                f"source names revision {at_rev!r} but the request's revision is {revision!r}",
                field="revision",
            )
        return _hub_spec(repo, at_rev or revision)
    if source.startswith("file://"):
        parsed = urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(
                f"file:// URI with a remote host {parsed.netloc!r} is not supported", field="source"
            )
        path = unquote(parsed.path)
        if "\0" in path:  # %00: no path holds a NUL, and the OS calls refuse one with a ValueError
            raise InvalidArgument(
                f"source {source[:200]!r} decodes to a path with a NUL byte", field="source"
            )
        return _local_spec(Path(path), revision, allowed_dirs)
    if source.startswith(("/", "./", "../", "~")):
        return _local_spec(Path(source).expanduser(), revision, allowed_dirs)
    if REPO_ID_RE.fullmatch(source):
        return _hub_spec(source, revision)
    raise InvalidArgument(
        f"source {source!r} is neither a Hub repo id (org/repo, hf://org/repo[@rev]) nor a local path "
        "(absolute, ./relative or file://)",
        field="source",
    )


def _hub_spec(repo: str, revision: str) -> SourceSpec:
    if not REPO_ID_RE.fullmatch(repo) or ".." in repo:
        raise InvalidArgument(f"Hub repo id {repo!r} is not of the form org/repo", field="source")
    if revision and (not REVISION_RE.fullmatch(revision) or ".." in revision):
        raise InvalidArgument(
            f"revision {revision[:80]!r} is not a branch, tag or commit name", field="revision"
        )
    return SourceSpec("hub", repo, revision, f"hf://{repo}")


def _local_spec(path: Path, revision: str, allowed_dirs: tuple[Path, ...]) -> SourceSpec:
    if revision:
        raise InvalidArgument(
            "revision applies to Hub sources only, not to a local directory", field="revision"
        )
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        real = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        real = Path(os.path.realpath(path))  # NotFound once resolved, unless outside the allowed dirs
    except OSError as e:  # a symlink loop, a name too long: the caller's input, not the store's fault
        raise InvalidArgument(
            f"local path {str(path)[:200]} cannot be resolved: {e.strerror}", field="source"
        ) from None
    check_allowed(real, allowed_dirs)
    return SourceSpec("local", str(real), "", real.as_uri())


def pick_weights_file(files: set[str], where: str, config: StoreConfig) -> str:
    """Which of a source's `files` holds the weights: safetensors, else a pickle where allowed."""
    if WEIGHTS_FILE in files:
        return WEIGHTS_FILE
    if PICKLE_FILE in files:
        if not config.allow_pickle:
            raise InvalidArgument(
                f"{where} has only {PICKLE_FILE} (a pickle); the store refuses pickles unless started "
                "with --allow-pickle. Convert it to adapter_model.safetensors instead.",
                field=PICKLE_FILE,
            )
        return PICKLE_FILE
    raise InvalidArgument(f"{where} has no {WEIGHTS_FILE}", field="source")


def check_size(total: int, where: str, config: StoreConfig) -> None:
    """Refuse a source whose files total over --max-adapter-bytes."""
    if total > config.max_adapter_bytes:
        raise InvalidArgument(
            f"{where}: adapter files total {total} bytes, over --max-adapter-bytes "
            f"{config.max_adapter_bytes}",
            field="size_bytes",
        )
