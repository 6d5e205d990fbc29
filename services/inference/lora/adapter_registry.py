"""The LoRA manager's registry: adapter names, their versions, and the host tier of their weights.

Contract (a mixin of `LoRAManager`, lora/manager.py, which owns the state and the one lock):
- A name maps to one *active* version (what new requests get). Loading the name with other
  content makes the old version *retiring*: it stays until no request computes on it (`refs`) or
  keeps it while suspended (`held`), then its slot and host copy go (`_forget_if_retired`). At most
  one version of a name holds references, so `release(name)` is never ambiguous.
- The host tier: host copies beyond `max_loaded_loras` (a count) or `max_cpu_lora_bytes` are
  dropped least recently used first (never one a request or pin holds, lora/host_tier.py) and
  re-read, digest-checked, from their source when next placed (`_weights_for_upload`).
- Public methods take the manager's lock and may run on any thread; they change only the registry
  and the slot queue, never the pool (freeing a retired version's slot is `_drop`, a pool release
  the engine thread orders). Methods named `_x` expect the lock held.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from loraplex.services.inference.errors import (
    AdapterIncompatible,
    AdapterNotFound,
    CapacityExceeded,
    LoraplexError,
)
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.config import check_fits, modules_of
from loraplex.services.inference.lora.dora import BaseWeight, fill_factors
from loraplex.services.inference.lora.embedding_lora import TP_REFUSAL as VOCAB_TP_REFUSAL
from loraplex.services.inference.lora.host_tier import copies_to_drop
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.vocab_tables import check_vocab_fits

log = logging.getLogger(__name__)


@dataclass(eq=False)
class AdapterVersion:
    """One loaded content of a name: the registry's record, and the residency's (slot, refs)."""

    name: str
    source: str
    digest: str
    rank: int
    alpha: float
    modules: list[str]
    weights: AdapterWeights | None  # host copy; None once dropped from the host cache
    chat_template: str | None = None  # read with the weights at load time; kept when they are dropped
    nbytes: int = 0  # of the host copy (the same each time it is re-read: the digest is checked)
    pinned: bool = False
    refs: int = 0  # requests computing on its slot (acquire/resume .. release/suspend)
    held: int = 0  # suspended requests: they keep this version (and their KV) but no slot
    slot: int = -1
    last_used: float = 0.0
    placed_at: float = 0.0
    reserved_until: float = 0.0
    uploads: int = 0
    popularity: float = -math.inf  # recent request rate (slot_choice.popularity_after)
    vocab: bool = False  # has vocabulary parts: needs a vocab slot too (lora/vocab_tables.py)
    pages: int = 0  # pool pages its upload takes (AdapterPool.pages_needed: its own rank, not the pool's)


class AdapterRegistry:
    """Registry by name + host LRU cache (the manager's state it reads and writes is listed here)."""

    pool: AdapterPool
    base_weight: BaseWeight | None
    max_loaded_loras: int | None
    max_cpu_lora_bytes: int | None
    _clock: Callable[[], float]
    _lock: threading.RLock
    _active: dict[str, AdapterVersion]
    _retiring: dict[str, AdapterVersion]
    _waiting: OrderedDict[str, float]
    _queued: Mapping[str, int]
    _evictions: dict[str, int]
    _host_hits: dict[str, int]
    _host_misses: dict[str, int]
    # From the other parts of the manager: `_drop` (lora/slot_residency.py) frees a version's slot
    # and host copy; `pin` puts an unplaced adapter in the slot queue (`_waiting`).

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> AdapterInfo:
        """Validate and register; replaces a same-named adapter once its running requests finish."""
        # Read and check outside the lock: a slow disk must not stall the engine thread's acquire.
        weights = load_adapter_weights(
            path,
            self.pool.shapes,
            dtype=self.pool.dtype,
            pin_memory=self.pool.device.type == "cuda",
        )
        check_fits(weights.all_targets, self.pool.max_rank, self.pool.target_modules)
        check_vocab_fits(weights, self.pool.max_rank, self.pool.vocab.max_token_rows)
        fill_factors(weights, self.base_weight)  # DoRA: once, here, not on every upload
        if weights.has_vocab_parts and self.base_weight is None:
            raise AdapterIncompatible(VOCAB_TP_REFUSAL, field="target_modules")
        with self._lock:
            old = self._active.get(name)
            if old is not None and old.digest == weights.digest:
                old.source = str(path)
                if old.weights is None:
                    old.weights = weights
            else:
                version = AdapterVersion(
                    name=name,
                    source=str(path),
                    digest=weights.digest,
                    rank=weights.max_rank,
                    alpha=weights.spec.lora_alpha,
                    modules=modules_of(weights.all_targets),
                    weights=weights,
                    chat_template=weights.chat_template,
                    nbytes=weights.nbytes,
                    last_used=self._clock(),
                    vocab=weights.has_vocab_parts,
                    pages=self.pool.pages_needed(weights),
                )
                self._active[name] = version
                if old is not None:
                    pin = pin or old.pinned
                    old.pinned = False
                    self._retire(old)
                    log.info("adapter %s: replacing %s with %s", name, old.digest[:19], version.digest[:19])
            if pin:
                self.pin(name)
            self._trim_host_cache()
            return self._info(self._active[name])

    def unload_adapter(self, name: str) -> None:
        """New requests for `name` fail at once; running ones finish, then slot and host copy go."""
        with self._lock:
            version = self._active.pop(name, None)
            if version is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded", adapter=name)
            self._waiting.pop(name, None)
            self._retire(version)

    def pin(self, name: str, pinned: bool = True) -> None:
        """Keep `name` resident. The limits leave one slot, one vocab slot and one max-rank upload's
        pages to rotate, so pins can never starve the slot queue."""
        with self._lock:
            version = self._get(name)
            if pinned and not version.pinned:
                others = sum(v.pinned for v in self._active.values())
                if others >= self.pool.slots - 1:
                    raise CapacityExceeded(
                        f"cannot pin {name!r}: at most {self.pool.slots - 1} of {self.pool.slots} slots "
                        "(the pool's slots - 1) may hold pinned adapters",
                        adapter=name,
                    )
                vocab_pins = sum(v.pinned and v.vocab for v in self._active.values())
                if version.vocab and vocab_pins >= self.pool.vocab.vocab_slots - 1:
                    raise CapacityExceeded(
                        f"cannot pin {name!r}: at most {self.pool.vocab.vocab_slots - 1} adapters with "
                        "embedding / lm_head LoRA or trainable tokens (the vocab slots - 1) may be pinned",
                        adapter=name,
                    )
                pinned_pages = sum(v.pages for v in self._active.values() if v.pinned) + version.pages
                if pinned_pages + self.pool.pages_per_slot > (
                    self.pool.guaranteed_pages or self.pool.num_pages
                ):
                    raise CapacityExceeded(
                        f"cannot pin {name!r}: pinned adapters would hold {pinned_pages} of the pool's "
                        f"{self.pool.num_pages} pages, leaving too few for a rank-{self.pool.max_rank} "
                        f"adapter ({self.pool.pages_per_slot} pages) to rotate",
                        adapter=name,
                    )
                if version.slot < 0:
                    self._waiting.setdefault(name, self._clock())  # becomes resident on the engine thread
            version.pinned = pinned

    def has_adapter(self, name: str) -> bool:
        with self._lock:
            return name in self._active

    def list_adapters(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(v) for v in self._active.values()]

    def chat_template(self, name: str) -> str | None:
        """The chat template the active version of `name` shipped (None: none, or not loaded)."""
        with self._lock:
            version = self._active.get(name)
            return version.chat_template if version is not None else None

    def content_digest(self, name: str) -> str | None:
        with self._lock:
            version = self._active.get(name)
            return version.digest if version is not None else None

    def host_bytes(self) -> int:
        """Bytes of adapter weights held in host memory (the host tier)."""
        with self._lock:
            versions = (*self._active.values(), *self._retiring.values())
            return sum(v.nbytes for v in versions if v.weights is not None)

    # ----- internals (lock held) -----

    def _get(self, name: str) -> AdapterVersion:
        version = self._active.get(name)
        if version is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", adapter=name)
        return version

    def _version_of(self, name: str) -> AdapterVersion | None:
        """The version a request of `name` would compute on: the retiring one while it has requests."""
        return self._retiring.get(name) or self._active.get(name)

    def _retire(self, version: AdapterVersion) -> None:
        if version.refs == 0 and version.held == 0:
            self._drop(version)
            return
        stale = self._retiring.get(version.name)
        if stale is not None and stale is not version:
            raise AssertionError("two versions of one name hold references")
        self._retiring[version.name] = version

    def _forget_if_retired(self, version: AdapterVersion) -> None:
        if version.refs == 0 and version.held == 0 and self._retiring.get(version.name) is version:
            del self._retiring[version.name]
            self._drop(version)

    def _weights_for_upload(self, version: AdapterVersion) -> AdapterWeights | None:
        """`version`'s weights for an upload: its host copy (a host hit), else re-read from its source
        (a miss). None if the source is gone or its content changed since load: the version is then
        unloaded (a version is its digest: other bytes would be another adapter under its name)."""
        weights = version.weights
        tally = self._host_hits if weights is not None else self._host_misses
        tally[version.name] = tally.get(version.name, 0) + 1
        if weights is not None:
            return weights
        try:
            weights = load_adapter_weights(
                version.source,
                self.pool.shapes,
                dtype=self.pool.dtype,
                pin_memory=self.pool.device.type == "cuda",
            )
            fill_factors(weights, self.base_weight)
        except LoraplexError as e:
            log.error("adapter %s: cannot re-read %s: %s", version.name, version.source, e.message)
            weights = None
        if weights is None or weights.digest != version.digest:
            log.error(
                "adapter %s: %s changed or vanished since load; unloading it",
                version.name,
                version.source,
            )
            if self._active.get(version.name) is version:
                del self._active[version.name]
            return None
        version.weights = weights
        return weights

    def _trim_host_cache(self, keep: AdapterVersion | None = None) -> None:
        """Apply the host tier's bounds (lora/host_tier.py): dropped copies are re-read when needed."""
        held = [v for v in (*self._active.values(), *self._retiring.values()) if v.weights is not None]
        for v in copies_to_drop(held, self.max_loaded_loras, self.max_cpu_lora_bytes, keep):
            v.weights = None

    def _info(self, v: AdapterVersion) -> AdapterInfo:
        location = "gpu" if v.slot >= 0 else ("host" if v.weights is not None else "store")
        return AdapterInfo(
            name=v.name,
            rank=v.rank,
            alpha=v.alpha,
            target_modules=list(v.modules),
            location=location,
            pinned=v.pinned,
            requests_in_flight=v.refs + v.held,
            source=v.source,
            digest=v.digest,
            slot=v.slot,
            evictions=self._evictions.get(v.name, 0),
            uploads=v.uploads,
            host_hits=self._host_hits.get(v.name, 0),
            host_misses=self._host_misses.get(v.name, 0),
            nbytes=v.nbytes,
            queued_requests=self._queued.get(v.name, 0),
            slot_wait_s=self._clock() - self._waiting[v.name] if v.name in self._waiting else 0.0,
        )
