"""LoRAManager: the adapter registry, host cache and GPU slot allocator (the engine's AdapterSlots).

It is one object in three parts, each a mixin with its own contract in its module docstring:
- lora/adapter_registry.py: names -> versions (active, retiring), loading, pins, the host tier.
- lora/slot_residency.py: which version sits in which slot on whose pages: acquire / resume /
  suspend / release, placement and eviction, vocab slots, the unified-memory share and reclaim.
- lora/slot_rotation.py: the slot queue (waiters, their order and aging) and the drains of busy
  slots for aged waiters.
The choices themselves are pure functions in lora/slot_choice.py and lora/host_tier.py.

This class owns all the state the parts share and the one lock that guards it. The parts stay one
object under one lock on purpose: a version's registry record is also its residency record
(`slot`, `refs`, `held`), and reload, unload, acquire and the drains each change both in one step,
so a second lock would either be taken everywhere together or let a request see half a change.

Invariants across the parts
- A name maps to one *active* version (what new requests get). Loading the name with other
  content makes the old version *retiring*; new requests for the name wait (`acquire` -> None)
  until the retiring version's running requests finish, so no request mixes two versions and
  `release(name)` is never ambiguous (at most one version of a name holds references).
- A slot is freed or re-used only when no request computes on it (`refs` 0); a version is
  dropped, and its host copy trimmed, only with `refs` and `held` (suspended requests) both 0.
- At most `slots - 1` adapters may be pinned (and `vocab_slots - 1` with vocabulary parts, and
  room left for one max-rank upload) so one slot always rotates; pinned slots never drain.

Threads: `acquire`/`release` (and `resume`/`suspend`/`prefetch`/`note_queued`) run on the engine
thread (they write the pool, ordered on its compute stream). `load`/`unload`/`pin`/`list` may run on
any thread; they only change the registry under the lock, and never touch the pool.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from loraplex.services.inference.lora.adapter_registry import AdapterRegistry, AdapterVersion
from loraplex.services.inference.lora.adapter_slots import AdapterSlots
from loraplex.services.inference.lora.dora import BaseWeight
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.slot_residency import RESERVE_S, SlotResidency
from loraplex.services.inference.lora.slot_rotation import (
    MIN_RESIDENT_S,
    QUEUED_CREDIT_S,
    SLOT_WAIT_S,
    SlotRotation,
)

__all__ = ["LoRAManager", "MIN_RESIDENT_S", "QUEUED_CREDIT_S", "RESERVE_S", "SLOT_WAIT_S"]


class LoRAManager(AdapterRegistry, SlotResidency, SlotRotation, AdapterSlots):
    """Registry by name + host LRU cache + refcounted slots of one `AdapterPool`."""

    def __init__(
        self,
        pool: AdapterPool,
        *,
        max_loaded_loras: int | None = None,
        max_cpu_lora_bytes: int | None = None,
        max_loras_per_batch: int | None = None,
        slot_wait_s: float = SLOT_WAIT_S,
        min_resident_s: float = MIN_RESIDENT_S,
        queued_credit_s: float = QUEUED_CREDIT_S,
        max_draining: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        base_weight: BaseWeight | None = None,
    ):
        """`base_weight`: the base model's projection rows, for DoRA's norms (None: the model is
        sharded, tensor parallelism: DoRA and embedding / lm_head adapters are refused)."""
        self.pool = pool
        self.base_weight = base_weight
        self.max_loaded_loras = max_loaded_loras
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.max_loras_per_batch = max_loras_per_batch
        self.slot_wait_s = slot_wait_s
        self.min_resident_s = min_resident_s
        self.queued_credit_s = queued_credit_s
        self.max_draining = max_draining or max(1, pool.slots // 4)
        self._clock = clock
        # The one lock of all three parts (see the module docstring for why there is only one).
        self._lock = threading.RLock()
        # registry (lora/adapter_registry.py)
        self._active: dict[str, AdapterVersion] = {}
        self._retiring: dict[str, AdapterVersion] = {}
        # residency (lora/slot_residency.py) and the slot queue (lora/slot_rotation.py)
        self._slots: list[AdapterVersion | None] = [None] * pool.slots
        self._waiting: OrderedDict[str, float] = OrderedDict()  # name -> when it started waiting for a slot
        self._draining: set[int] = set()
        self._queued: Mapping[str, int] = {}  # name -> requests in the scheduler's queue (last report)
        # metrics
        self._evictions: dict[str, int] = {}  # per name, cumulative (for metrics)
        self.num_uploads = 0  # adapters copied into a slot, cumulative (for metrics)
        # host tier (for metrics): placements served from a host copy / re-read from disk, bytes copied
        self._host_hits: dict[str, int] = {}
        self._host_misses: dict[str, int] = {}
        self.upload_bytes = 0
        self.num_suspensions = 0  # running requests that gave their slot up (suspend), cumulative
        self.num_reclaims = 0  # adapters evicted because the KV cache needed their pages (lora/unified.py)
        self.run_blocks = 0  # KV blocks per page, where the pages live in the KV cache (lora/unified.py bind)
