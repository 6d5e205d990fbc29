"""The Hub side of a source (source_fetcher.py): its commit and files resolved, the files downloaded
pinned to that commit under the byte limit, the Hub's errors mapped to the store's.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from loraplex.adapter_store.local_files import Stopped
from loraplex.adapter_store.lora_config import CONFIG_FILE
from loraplex.adapter_store.progress import DownloadBudget, bounded_progress
from loraplex.adapter_store.sources import ResolvedSource, SourceSpec, check_size, pick_weights_file
from loraplex.adapter_store.tokenizer_files import CARRIED_FILES

log = logging.getLogger(__name__)
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
DOWNLOAD_CHUNK_BYTES = 1 << 20


class HubSource:
    """Resolves and downloads Hub sources; blocking (call from a worker thread)."""

    def __init__(self, config: StoreConfig):
        self.config = config

    def resolve(self, spec: SourceSpec) -> ResolvedSource:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.config.hf_endpoint, token=self.config.hf_token)
        info = _hub_call(spec, lambda: api.model_info(spec.location, revision=spec.revision or None))
        if not info.sha or not COMMIT_RE.fullmatch(info.sha):
            raise Unavailable(f"the Hub answered no commit sha for {spec.location}@{spec.revision or 'main'}")
        files = {s.rfilename for s in (info.siblings or [])}
        if CONFIG_FILE not in files:
            raise InvalidArgument(
                f"Hub repo {spec.location}@{info.sha[:12]} has no {CONFIG_FILE}: not a PEFT adapter repo",
                field="source",
            )
        weights_file = pick_weights_file(files, f"Hub repo {spec.location}", self.config)
        tokenizer_files = tuple(n for n in CARRIED_FILES if n in files)
        # The files read count too: a record made before tokenizer files were carried is fetched again.
        fingerprint = "|".join((info.sha, *tokenizer_files))
        return ResolvedSource(spec, info.sha, fingerprint, weights_file, tokenizer_files)

    def download(
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
        total = sum(_hub_call(spec, lambda n=n: download(n, dry_run=True)).file_size or 0 for n in names)
        check_size(total, where, self.config)
        for name in names:
            log.info("fetching hf://%s@%s/%s", spec.location, sha[:12], name)
            path = Path(_hub_call(spec, lambda n=name: _until_stopped(lambda: download(n), stop, where)))
            if path != staging / name:
                shutil.move(path, staging / name)


def _hub_call(spec: SourceSpec, call):
    """`call()`, a request to the Hub about `spec`; its errors as the store's, with the status each means."""
    import httpx2
    from huggingface_hub import errors as hf

    where = f"hf://{spec.location}" + (f"@{spec.revision}" if spec.revision else "")
    try:
        return call()
    except hf.GatedRepoError as e:
        raise PermissionDenied(f"{where} is gated: the store's HF_TOKEN lacks access ({_short(e)})") from None
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
