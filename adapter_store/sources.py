"""Adapter sources: parse what a caller names, resolve it cheaply, fetch it into a staging dir.

Accepted sources:
- `hf://org/repo`, `hf://org/repo@rev`, `org/repo` — a Hugging Face Hub model repo
  (revision = branch, tag or commit; HF_TOKEN / HF_ENDPOINT honoured);
- `file:///abs/dir`, `/abs/dir`, `./dir`, `~/dir` — a local PEFT adapter directory.
Only `adapter_config.json` and `adapter_model.safetensors` (or, with --allow-pickle,
`adapter_model.bin`) are read, and the small tokenizer files of tokenizer_files.py when present.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlparse

from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from loraplex.adapter_store.local_files import Stopped, check_allowed, copy_regular_file, resolve_file
from loraplex.adapter_store.lora_config import CONFIG_FILE
from loraplex.adapter_store.pickle_convert import PICKLE_FILE, convert_pickle_to_safetensors
from loraplex.adapter_store.progress import DownloadBudget, bounded_progress
from loraplex.adapter_store.tokenizer_files import CARRIED_FILES
from loraplex.adapter_store.validate import WEIGHTS_FILE

log = logging.getLogger(__name__)
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9._/-]{1,256}$")
MAX_SOURCE_CHARS = 4096
DOWNLOAD_CHUNK_BYTES = 1 << 20


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
    tokenizer_files: dict[str, bytes]  # unchecked: registry.py checks them with the rest


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


class SourceFetcher:
    """Resolves and fetches sources; blocking (call from a worker thread)."""

    def __init__(self, config: StoreConfig):
        self.config = config

    # -- resolve: cheap, decides whether a fetch is needed at all --------------------------------
    def resolve(self, spec: SourceSpec) -> ResolvedSource:
        if spec.kind == "hub":
            return self._resolve_hub(spec)
        try:
            return self._resolve_local(spec)
        except PermissionError as e:
            raise PermissionDenied(
                f"the store cannot read {e.filename or spec.location}: {e.strerror}"
            ) from None

    def _resolve_local(self, spec: SourceSpec) -> ResolvedSource:
        directory = Path(spec.location)
        if not directory.is_dir():
            raise NotFound(f"local adapter directory {directory} does not exist", field="source")
        config_path = directory / CONFIG_FILE
        if not os.path.lexists(config_path):
            raise InvalidArgument(
                f"{directory} has no {CONFIG_FILE}: not a PEFT adapter directory", field="source"
            )
        names = {p.name for p in directory.iterdir()}
        weights_file = self._pick_weights_file(names, str(directory))
        tokenizer_files = tuple(n for n in CARRIED_FILES if n in names)
        parts, total = [], 0
        for name in (CONFIG_FILE, weights_file, *tokenizer_files):
            _real, st = resolve_file(directory / name, self.config.allowed_local_dirs)
            total += st.st_size
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
        self._check_size(total, str(directory))
        return ResolvedSource(spec, "", "|".join(parts), weights_file, tokenizer_files)

    def _resolve_hub(self, spec: SourceSpec) -> ResolvedSource:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.config.hf_endpoint, token=self.config.hf_token)
        info = self._hub_call(spec, lambda: api.model_info(spec.location, revision=spec.revision or None))
        if not info.sha or not COMMIT_RE.fullmatch(info.sha):
            raise Unavailable(f"the Hub answered no commit sha for {spec.location}@{spec.revision or 'main'}")
        files = {s.rfilename for s in (info.siblings or [])}
        if CONFIG_FILE not in files:
            raise InvalidArgument(
                f"Hub repo {spec.location}@{info.sha[:12]} has no {CONFIG_FILE}: not a PEFT adapter repo",
                field="source",
            )
        weights_file = self._pick_weights_file(files, f"Hub repo {spec.location}")
        tokenizer_files = tuple(n for n in CARRIED_FILES if n in files)
        # The files read count too: a record made before tokenizer files were carried is fetched again.
        fingerprint = "|".join((info.sha, *tokenizer_files))
        return ResolvedSource(spec, info.sha, fingerprint, weights_file, tokenizer_files)

    def _pick_weights_file(self, files: set[str], where: str) -> str:
        if WEIGHTS_FILE in files:
            return WEIGHTS_FILE
        if PICKLE_FILE in files:
            if not self.config.allow_pickle:
                raise InvalidArgument(
                    f"{where} has only {PICKLE_FILE} (a pickle); the store refuses pickles unless started "
                    "with --allow-pickle. Convert it to adapter_model.safetensors instead.",
                    field=PICKLE_FILE,
                )
            return PICKLE_FILE
        raise InvalidArgument(f"{where} has no {WEIGHTS_FILE}", field="source")

    def _check_size(self, total: int, where: str) -> None:
        if total > self.config.max_adapter_bytes:
            raise InvalidArgument(
                f"{where}: adapter files total {total} bytes, over --max-adapter-bytes "
                f"{self.config.max_adapter_bytes}",
                field="size_bytes",
            )

    # -- fetch: copy or download into `staging` ------------------------------------------------
    def fetch(
        self, resolved: ResolvedSource, staging: Path, stop: Callable[[], bool] | None = None
    ) -> FetchedAdapter:
        """Copy (local) or download (Hub) the config and weights into `staging`, convert a pickle to
        safetensors, and check the total size again. `stop` set (the caller went away, the store
        shuts down) abandons a local copy."""
        staging.mkdir(parents=True, exist_ok=True)
        if resolved.spec.kind == "hub":
            self._download_hub(resolved, staging, stop)
        else:
            budget = self.config.max_adapter_bytes
            for name in (CONFIG_FILE, resolved.weights_file, *resolved.tokenizer_files):
                src = Path(resolved.spec.location) / name
                try:
                    # Resolved again: the directory may have changed since `resolve`.
                    real, _st = resolve_file(src, self.config.allowed_local_dirs)
                    budget -= copy_regular_file(real, staging / name, budget, stop)
                except FileNotFoundError:
                    raise NotFound(f"{src} disappeared while registering", field="source") from None
                except PermissionError as e:
                    raise PermissionDenied(f"the store cannot read {src}: {e.strerror}") from None
        weights = staging / WEIGHTS_FILE
        if resolved.weights_file == PICKLE_FILE:
            convert_pickle_to_safetensors(staging / PICKLE_FILE, weights)
            (staging / PICKLE_FILE).unlink()
        # Sizes again: a local file may have grown since resolve, a Hub file may be bigger than listed.
        others = [staging / n for n in (CONFIG_FILE, *resolved.tokenizer_files)]
        total = sum(p.stat().st_size for p in others) + weights.stat().st_size
        self._check_size(total, resolved.spec.canonical)
        tokenizer_files = {n: (staging / n).read_bytes() for n in resolved.tokenizer_files}
        config_raw = (staging / CONFIG_FILE).read_bytes()
        return FetchedAdapter(config_raw, weights, resolved.revision, tokenizer_files)

    def _download_hub(
        self, resolved: ResolvedSource, staging: Path, stop: Callable[[], bool] | None = None
    ) -> None:
        """Download the config and weights. The advertised sizes are checked first (a cheap early
        refusal), but not trusted: every byte is counted as it arrives against --max-adapter-bytes,
        and the download stops past it, or when `stop` is set (the partial file goes with `staging`)."""
        from huggingface_hub import constants, hf_hub_download

        # Xet transfers run in native code whose bytes this process can neither count nor stop;
        # adapters are small, so plain HTTP (counted chunk by chunk below) costs little. And the
        # body is counted per chunk read, 10 MiB by default: 1 MiB bounds how long a slow download
        # runs on after its caller went (these are the store process's own settings).
        constants.HF_HUB_DISABLE_XET = True
        constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, DOWNLOAD_CHUNK_BYTES)
        spec, sha = resolved.spec, resolved.revision
        where = f"hf://{spec.location}@{sha[:12]}"
        progress = bounded_progress(DownloadBudget(self.config.max_adapter_bytes, where, stop))

        def download(name: str, dry_run: bool = False):
            return hf_hub_download(
                spec.location,
                name,
                revision=sha,  # pinned: every file comes from the one resolved commit
                local_dir=staging,
                endpoint=self.config.hf_endpoint,
                token=self.config.hf_token,
                tqdm_class=progress,
                dry_run=dry_run,
            )

        names = (CONFIG_FILE, resolved.weights_file, *resolved.tokenizer_files)
        total = sum(self._hub_call(spec, lambda n=n: download(n, dry_run=True)).file_size or 0 for n in names)
        self._check_size(total, where)
        for name in names:
            log.info("fetching hf://%s@%s/%s", spec.location, sha[:12], name)
            path = Path(self._hub_call(spec, lambda n=name: _until_stopped(lambda: download(n), stop, where)))
            if path != staging / name:
                shutil.move(path, staging / name)

    def _hub_call(self, spec: SourceSpec, call):
        import httpx2
        from huggingface_hub import errors as hf

        where = f"hf://{spec.location}" + (f"@{spec.revision}" if spec.revision else "")
        try:
            return call()
        except hf.GatedRepoError as e:
            raise PermissionDenied(
                f"{where} is gated: the store's HF_TOKEN lacks access ({_short(e)})"
            ) from None
        except hf.RepositoryNotFoundError as e:
            if e.response is not None and e.response.status_code == 401:
                # The Hub answers 401 for private repos without valid credentials.
                raise PermissionDenied(
                    f"{where}: the Hub refused access (HTTP 401): the repo is private or missing and the "
                    "store's HF_TOKEN is unset or lacks access"
                ) from None
            raise NotFound(f"{where}: repository not found", field="source") from None
        except hf.RevisionNotFoundError:
            raise NotFound(f"{where}: revision {spec.revision!r} not found", field="revision") from None
        except hf.RemoteEntryNotFoundError as e:
            raise InvalidArgument(f"{where}: file missing: {_short(e)}", field="source") from None
        except hf.HFValidationError as e:
            raise InvalidArgument(f"{where}: {e}", field="source") from None
        except hf.HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else 0
            if status in (401, 403):
                raise PermissionDenied(
                    f"{where}: the Hub refused access (HTTP {status}); set HF_TOKEN for the store to a token "
                    "that can read this repo"
                ) from None
            if status == 413:
                raise ResourceExhausted(f"{where}: {_short(e)}") from None
            raise Unavailable(f"{where}: the Hub answered HTTP {status}: {_short(e)}") from None
        except (OSError, httpx2.HTTPError) as e:  # refused/reset, timeouts, size mismatch after retries
            raise Unavailable(f"{where}: could not reach or read from the Hub: {_short(e)}") from None


def _until_stopped(call: Callable[[], object], stop: Callable[[], bool] | None, where: str) -> object:
    """`call()` on a daemon thread, given up once `stop` is set. A download stops itself at its next
    chunk (bounded_progress); one whose endpoint has gone quiet would hold this worker thread, and
    with it the store's exit, until the read timeout, so it is left to end on its own."""
    if stop is None:
        return call()
    done = threading.Event()
    result: list = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name="hub-download", daemon=True).start()
    while not done.wait(0.2):
        if stop():
            raise Stopped(f"{where}: download abandoned (caller gone or store shutting down)")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
