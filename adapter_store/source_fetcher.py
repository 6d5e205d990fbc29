"""SourceFetcher: resolve a source cheaply (is a fetch needed at all?), then fetch it into a staging
dir: a local directory's files here, file by file confined and copied (local_files.py), the Hub's
through hub_source.py; then the checks both kinds share (pickle converted, total size again).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import InvalidArgument, NotFound, PermissionDenied
from loraplex.adapter_store.hub_source import HubSource
from loraplex.adapter_store.local_files import copy_regular_file, resolve_file
from loraplex.adapter_store.lora_config import CONFIG_FILE
from loraplex.adapter_store.pickle_convert import PICKLE_FILE, convert_pickle_to_safetensors
from loraplex.adapter_store.sources import (
    FetchedAdapter,
    ResolvedSource,
    SourceSpec,
    check_size,
    pick_weights_file,
)
from loraplex.adapter_store.tokenizer_files import CARRIED_FILES
from loraplex.adapter_store.validate import WEIGHTS_FILE


class SourceFetcher:
    """Resolves and fetches sources; blocking (call from a worker thread)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.hub = HubSource(config)

    # -- resolve: cheap, decides whether a fetch is needed at all --------------------------------
    def resolve(self, spec: SourceSpec) -> ResolvedSource:
        if spec.kind == "hub":
            return self.hub.resolve(spec)
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
        weights_file = pick_weights_file(names, str(directory), self.config)
        tokenizer_files = tuple(n for n in CARRIED_FILES if n in names)
        parts, total = [], 0
        for name in (CONFIG_FILE, weights_file, *tokenizer_files):
            _real, st = resolve_file(directory / name, self.config.allowed_local_dirs)
            total += st.st_size
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
        check_size(total, str(directory), self.config)
        return ResolvedSource(spec, "", "|".join(parts), weights_file, tokenizer_files)

    # -- fetch: copy or download into `staging` ------------------------------------------------
    def fetch(
        self, resolved: ResolvedSource, staging: Path, stop: Callable[[], bool] | None = None
    ) -> FetchedAdapter:
        """Copy (local) or download (Hub) the config and weights into `staging`, convert a pickle to
        safetensors, and check the total size again. `stop` set (the caller went away, the store
        shuts down) abandons a local copy."""
        staging.mkdir(parents=True, exist_ok=True)
        if resolved.spec.kind == "hub":
            self.hub.download(resolved, staging, stop)
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
        check_size(total, resolved.spec.canonical, self.config)
        tokenizer_files = {n: (staging / n).read_bytes() for n in resolved.tokenizer_files}
        config_raw = (staging / CONFIG_FILE).read_bytes()
        return FetchedAdapter(config_raw, weights, resolved.revision, tokenizer_files)
