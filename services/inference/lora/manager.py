"""LoRAManager: the adapter registry, host cache and GPU slot allocator (the engine's AdapterSlots).

Invariants
- A name maps to one *active* version (what new requests get). Loading the name with other
  content makes the old version *retiring*; new requests for the name wait (`acquire` -> None)
  until the retiring version's running requests finish, so no request mixes two versions and
  `release(name)` is never ambiguous (at most one version of a name holds references).
- A slot is freed or re-used only when its version has no running request (refcount 0).
  Eviction is LRU among such unpinned slots.
- Fairness: an adapter refused a slot joins a FIFO; as many busy unpinned slots as there are
  waiting adapters stop taking new requests (*draining*) and, once empty, go to the FIFO's
  head. A waiting adapter thus gets a slot once the requests already running in a draining
  slot finish. At most `slots - 1` adapters may be pinned so one slot always rotates.

Threads: `acquire`/`release` run on the engine thread (they write the pool, ordered on its
compute stream). `load`/`unload`/`pin`/`list` may run on any thread; they only change the
registry under the lock, and never touch the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from services.inference.engine.adapter_slots import AdapterSlots
from services.inference.engine.types import AdapterInfo
from services.inference.errors import AdapterNotFound, CapacityExceeded, LoraplexError
from services.inference.lora.adapter import AdapterWeights, load_adapter_weights
from services.inference.lora.config import check_fits, modules_of
from services.inference.lora.pool import AdapterPool

log = logging.getLogger(__name__)

# A slot handed to a waiting adapter is kept for it this long even before its request takes it.
RESERVE_S = 2.0


@dataclass(eq=False)
class _Version:
    name: str
    source: str
    digest: str
    rank: int
    alpha: float
    modules: list[str]
    weights: AdapterWeights | None  # host copy; None once dropped from the host cache
    pinned: bool = False
    refs: int = 0
    slot: int = -1
    last_used: float = field(default_factory=time.monotonic)
    placed_at: float = 0.0
    reserved_until: float = 0.0


class LoRAManager(AdapterSlots):
    """Registry by name + host LRU cache + refcounted slots of one `AdapterPool`."""

    def __init__(self, pool: AdapterPool, *, max_loaded_loras: int | None = None):
        self.pool = pool
        self.max_loaded_loras = max_loaded_loras
        self._lock = threading.RLock()
        self._active: dict[str, _Version] = {}
        self._retiring: dict[str, _Version] = {}
        self._slots: list[_Version | None] = [None] * pool.slots
        self._waiting: OrderedDict[str, None] = OrderedDict()
        self._draining: set[int] = set()
        self._evictions: dict[str, int] = {}  # per name, cumulative (for metrics)

    # ----- registry (any thread) -----

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> AdapterInfo:
        """Validate and register; replaces a same-named adapter once its running requests finish."""
        weights = load_adapter_weights(path, self.pool.shapes, dtype=self.pool.dtype,
                                       pin_memory=self.pool.device.type == "cuda")
        check_fits(weights.targets, self.pool.max_rank, self.pool.target_modules)
        with self._lock:
            old = self._active.get(name)
            if old is not None and old.digest == weights.digest:
                old.source = str(path)
                if old.weights is None:
                    old.weights = weights
            else:
                version = _Version(name=name, source=str(path), digest=weights.digest, rank=weights.max_rank,
                                   alpha=weights.spec.lora_alpha, modules=modules_of(weights.targets),
                                   weights=weights)
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
        with self._lock:
            version = self._get(name)
            if pinned and not version.pinned:
                others = sum(v.pinned for v in self._active.values())
                if others >= self.pool.slots - 1:
                    raise CapacityExceeded(
                        f"cannot pin {name!r}: at most {self.pool.slots - 1} of {self.pool.slots} slots "
                        "(--max-loras-per-batch - 1) may hold pinned adapters", adapter=name)
                if version.slot < 0:
                    self._waiting.setdefault(name)  # becomes resident on the engine thread
            version.pinned = pinned

    def has_adapter(self, name: str) -> bool:
        with self._lock:
            return name in self._active

    def list_adapters(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(v) for v in self._active.values()]

    def content_digest(self, name: str) -> str | None:
        with self._lock:
            version = self._active.get(name)
            return version.digest if version is not None else None

    def slot_digest(self, slot: int) -> str | None:
        with self._lock:
            version = self._slots[slot]
            return version.digest if version is not None else None

    def slots_total(self) -> int:
        return self.pool.slots

    def slots_used(self) -> int:
        """Slots holding an adapter (resident, whether or not a request runs on it)."""
        with self._lock:
            return sum(v is not None for v in self._slots)

    # ----- slots (engine thread) -----

    def acquire(self, name: str) -> int | None:
        """A slot holding `name` for one more running request, or None (wait; upload started)."""
        with self._lock:
            version = self._get(name)
            version.last_used = time.monotonic()
            if name in self._retiring:
                return None
            if version.slot < 0:
                self._rebalance()  # earlier waiters first
            if version.slot < 0:
                slot = self._evictable_slot()
                if slot is None:
                    self._waiting.setdefault(name)
                    self._rebalance()
                    return None
                if not self._place(version, slot):
                    raise AdapterNotFound(f"adapter {name!r} could not be re-read from {version.source}",
                                          adapter=name)
                self._waiting.pop(name, None)
            if version.slot in self._draining or not self.pool.ready(version.slot):
                return None
            version.refs += 1
            version.reserved_until = 0.0
            return version.slot

    def prefetch(self, name: str) -> None:
        """Upload `name` into an idle slot ahead of its requests (the scheduler's hint).

        Adapters already waiting for a slot go first (fairness), and only slots `acquire` itself
        could take are used; the placed adapter is then reserved for RESERVE_S like any other."""
        with self._lock:
            version = self._active.get(name)
            if version is None or version.slot >= 0 or name in self._retiring or self._waiting:
                return
            slot = self._evictable_slot()
            if slot is not None:
                self._place(version, slot)  # False (source gone) is reported by the next acquire

    def release(self, name: str) -> None:
        """One request that acquired `name` finished, aborted or was preempted."""
        with self._lock:
            version = self._retiring.get(name) or self._active.get(name)
            if version is None or version.refs == 0:
                log.warning("release(%r) without a matching acquire", name)
                return
            version.refs -= 1
            if version.refs > 0:
                return
            self._draining.discard(version.slot)
            if self._retiring.get(name) is version:
                del self._retiring[name]
                self._drop(version)
            self._rebalance()

    # ----- internals (lock held) -----

    def _get(self, name: str) -> _Version:
        version = self._active.get(name)
        if version is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", adapter=name)
        return version

    def _retire(self, version: _Version) -> None:
        if version.refs == 0:
            self._drop(version)
            return
        stale = self._retiring.get(version.name)
        if stale is not None and stale is not version:
            raise AssertionError("two versions of one name hold references")
        self._retiring[version.name] = version

    def _drop(self, version: _Version) -> None:
        if version.slot >= 0:
            self._draining.discard(version.slot)
            self._slots[version.slot] = None
            version.slot = -1
        version.weights = None

    def _evictable_slot(self) -> int | None:
        now = time.monotonic()
        best, best_used = None, None
        for slot, v in enumerate(self._slots):
            if v is None:
                return slot
            if v.refs or v.pinned or slot in self._draining or v.reserved_until > now:
                continue
            if best_used is None or v.last_used < best_used:
                best, best_used = slot, v.last_used
        return best

    def _place(self, version: _Version, slot: int) -> bool:
        """Upload `version` into `slot`, evicting its occupant (refcount 0). False if unreadable."""
        weights = version.weights
        if weights is None:
            try:
                weights = load_adapter_weights(version.source, self.pool.shapes, dtype=self.pool.dtype,
                                               pin_memory=self.pool.device.type == "cuda")
            except LoraplexError as e:
                log.error("adapter %s: cannot re-read %s: %s", version.name, version.source, e.message)
                weights = None
            if weights is None or weights.digest != version.digest:
                log.error("adapter %s: %s changed or vanished since load; unloading it", version.name,
                          version.source)
                if self._active.get(version.name) is version:
                    del self._active[version.name]
                return False
            version.weights = weights
        occupant = self._slots[slot]
        if occupant is not None:
            occupant.slot = -1
            self._evictions[occupant.name] = self._evictions.get(occupant.name, 0) + 1
        self.pool.upload(slot, weights)
        self._slots[slot] = version
        version.slot = slot
        version.placed_at = time.monotonic()
        version.reserved_until = version.placed_at + RESERVE_S
        self._trim_host_cache()
        return True

    def _rebalance(self) -> None:
        """Serve waiting adapters from evictable slots, then drain enough busy slots for the rest."""
        while self._waiting:
            name = next(iter(self._waiting))
            version = self._active.get(name)
            if version is None or version.slot >= 0 or name in self._retiring:
                self._waiting.pop(name)
                continue
            slot = self._evictable_slot()
            if slot is None:
                break
            self._waiting.pop(name)
            self._place(version, slot)
        need = len(self._waiting) - len(self._draining)
        if need <= 0:
            return
        busy = [(v.placed_at, s) for s, v in enumerate(self._slots)
                if v is not None and v.refs and not v.pinned and s not in self._draining]
        for _, slot in sorted(busy)[:need]:
            self._draining.add(slot)

    def _trim_host_cache(self) -> None:
        """Keep at most `max_loaded_loras` host copies: drop LRU ones no request or pin needs."""
        if self.max_loaded_loras is None:
            return
        held = [v for v in (*self._active.values(), *self._retiring.values()) if v.weights is not None]
        excess = len(held) - self.max_loaded_loras
        for v in sorted(held, key=lambda v: v.last_used):
            if excess <= 0:
                break
            if v.refs == 0 and not v.pinned:
                v.weights = None  # re-read from its source (digest-checked) when next needed
                excess -= 1

    def _info(self, v: _Version) -> AdapterInfo:
        location = "gpu" if v.slot >= 0 else ("host" if v.weights is not None else "store")
        return AdapterInfo(name=v.name, rank=v.rank, alpha=v.alpha, target_modules=list(v.modules),
                           location=location, pinned=v.pinned, requests_in_flight=v.refs, source=v.source,
                           digest=v.digest, slot=v.slot, evictions=self._evictions.get(v.name, 0))

