"""LoRAManager: the adapter registry, host cache and GPU slot allocator (the engine's AdapterSlots).

Invariants (the choices themselves, eviction, queue order and drains: lora/slot_choice.py)
- A name maps to one *active* version (what new requests get). Loading the name with other
  content makes the old version *retiring*; new requests for the name wait (`acquire` -> None)
  until the retiring version's running requests finish, so no request mixes two versions and
  `release(name)` is never ambiguous (at most one version of a name holds references).
- A slot is freed or re-used only when no request computes on it (`refs` 0). A request that
  gave its slot up (`suspend`: the scheduler keeps its KV) still holds its version (`held`), so a
  version is dropped, and its host copy trimmed, only with `refs` and `held` both 0.
- Admission without a cliff: a slot is a scheduling resource, not a request limit. Resident
  adapters keep taking new requests while others wait. An adapter refused a slot joins the slot
  queue, served longest-waiting first where each queued request counts as `queued_credit_s` of
  waiting (every waiter ages to the front). Once a waiter has waited `slot_wait_s`, busy slots
  drain for the aged waiters (at most `max_draining` at once): a draining slot takes no new
  requests and the scheduler suspends the requests on it (`yielding`), so it frees at the next
  step. Only slots placed `min_resident_s` ago drain (the quantum), least popular first, and only
  adapters no more popular than the most popular aged waiter unless every slot holds a hotter one.
  Bound: the queue's front gets a slot within `slot_wait_s` + `min_resident_s` + 2 steps
  (docs/architecture.md, "LoRA manager", states the rest). At most `slots - 1` adapters may be
  pinned so one slot always rotates; pinned slots never drain.
- Pages (lora/pool.py): an adapter takes pages of its own rank. A placement short of free pages
  evicts further idle adapters, cheapest first, only if that makes room (`_room_for`); an adapter
  a request computes on keeps its pages. Pinned adapters leave room for one max-rank upload.
- The host tier: host copies beyond `max_loaded_loras` (a count) or `max_cpu_lora_bytes` are
  dropped least recently used first (never one a request or pin holds) and re-read, digest-checked,
  from their source when next placed.
- Vocab slots (lora/vocab_tables.py): an adapter with embedding / lm_head LoRA or trainable tokens
  also needs one of the pool's few vocab slots. It is placed only into a slot where one is free or
  whose evicted occupant frees one; otherwise it waits in the slot queue (later waiters that need no
  vocab slot are served meanwhile), and an aged one drains a busy vocab-holding slot. At most
  `vocab_slots - 1` such adapters may be pinned.

Threads: `acquire`/`release` run on the engine thread (they write the pool, ordered on its
compute stream). `load`/`unload`/`pin`/`list` may run on any thread; they only change the
registry under the lock, and never touch the pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time
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
from loraplex.services.inference.lora.adapter import AdapterWeights, load_adapter_weights
from loraplex.services.inference.lora.adapter_slots import AdapterInfo, AdapterSlots
from loraplex.services.inference.lora.config import check_fits, modules_of
from loraplex.services.inference.lora.dora import BaseWeight, fill_factors
from loraplex.services.inference.lora.embedding_lora import TP_REFUSAL as VOCAB_TP_REFUSAL
from loraplex.services.inference.lora.host_tier import copies_to_drop
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.slot_choice import (
    cheapest_busy_slots,
    evictable_slot,
    idle_slots,
    next_waiter,
    popularity_after,
)
from loraplex.services.inference.lora.vocab_tables import check_vocab_fits

log = logging.getLogger(__name__)

# A slot handed to a waiting adapter is kept for it this long even before its request takes it.
RESERVE_S = 2.0
# How long a waiter in the slot queue waits for a slot to free by itself before one is drained for it;
# also what one queued request is worth in the queue's order (see slot_choice.next_waiter).
SLOT_WAIT_S = 0.05
# What one queued request (not yet started: it owes a first token) is worth in the slot queue's
# order, in seconds of waiting: adapters with queued requests go before those whose requests all run
# (suspended), which still age to the front.
QUEUED_CREDIT_S = 1.0
# A slot placed this recently is not drained for another waiter (the rotation's quantum: each
# upload buys its adapter at least this long on the GPU, so slots cannot thrash).
MIN_RESIDENT_S = 0.1


@dataclass(eq=False)
class _Version:
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


class LoRAManager(AdapterSlots):
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
        self._lock = threading.RLock()
        self._active: dict[str, _Version] = {}
        self._retiring: dict[str, _Version] = {}
        self._slots: list[_Version | None] = [None] * pool.slots
        self._waiting: OrderedDict[str, float] = OrderedDict()  # name -> when it started waiting for a slot
        self._draining: set[int] = set()
        self._queued: Mapping[str, int] = {}  # name -> requests in the scheduler's queue (last report)
        self._evictions: dict[str, int] = {}  # per name, cumulative (for metrics)
        self.num_uploads = 0  # adapters copied into a slot, cumulative (for metrics)
        # host tier (for metrics): placements served from a host copy / re-read from disk, bytes copied
        self._host_hits: dict[str, int] = {}
        self._host_misses: dict[str, int] = {}
        self.upload_bytes = 0
        self.num_suspensions = 0  # running requests that gave their slot up (suspend), cumulative
        self.num_reclaims = 0  # adapters evicted because the KV cache needed their pages (lora/unified.py)
        self.run_blocks = 0  # KV blocks per page, where the pages live in the KV cache (lora/unified.py bind)

    # ----- registry (any thread) -----

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> AdapterInfo:
        """Validate and register; replaces a same-named adapter once its running requests finish."""
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
                version = _Version(
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

    def slot_digest(self, slot: int) -> str | None:
        with self._lock:
            version = self._slots[slot]
            return version.digest if version is not None else None

    def batch_cap(self) -> int | None:
        return self.max_loras_per_batch

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
            version.last_used = self._clock()
            if name in self._retiring:
                return None
            if not self._claim(version):
                return None
            version.popularity = popularity_after(version.popularity, version.last_used)
            version.refs += 1
            version.reserved_until = 0.0
            return version.slot

    def suspend(self, name: str) -> None:
        """A running request of `name` gives up its slot and keeps its version (the scheduler keeps
        its KV): the slot frees when no request computes on it, and `resume` takes one again."""
        with self._lock:
            version = self._retiring.get(name) or self._active.get(name)
            if version is None or version.refs == 0:
                log.warning("suspend(%r) without a matching acquire", name)
                return
            version.refs -= 1
            version.held += 1
            self.num_suspensions += 1
            if version.refs == 0:
                self._draining.discard(version.slot)
                self._rebalance()

    def resume(self, name: str) -> int | None:
        """A slot holding the version a suspended request of `name` kept, or None (it waits in the
        slot queue like any adapter; an upload may have started)."""
        with self._lock:
            version = self._retiring.get(name) or self._active.get(name)
            if version is None or version.held == 0:
                raise AdapterNotFound(f"adapter {name!r} has no suspended request to resume", adapter=name)
            version.last_used = self._clock()
            if not self._claim(version):
                return None
            version.held -= 1
            version.refs += 1
            version.reserved_until = 0.0
            return version.slot

    def release_suspended(self, name: str) -> None:
        """A suspended request of `name` finished or was aborted without resuming."""
        with self._lock:
            version = self._retiring.get(name) or self._active.get(name)
            if version is None or version.held == 0:
                log.warning("release_suspended(%r) without a matching suspend", name)
                return
            version.held -= 1
            self._forget_if_retired(version)

    def yielding(self) -> frozenset[str]:
        """Adapters whose slot drains for a waiting adapter: their running requests should suspend."""
        with self._lock:
            return frozenset(v.name for s in self._draining if (v := self._slots[s]) is not None and v.refs)

    def prefetch(self, name: str) -> None:
        """Upload `name` into an idle slot ahead of its requests (the scheduler's hint).

        Adapters already waiting for a slot go first (fairness), and only slots `acquire` itself
        could take are used; the placed adapter is then reserved for RESERVE_S like any other."""
        with self._lock:
            version = self._active.get(name)
            if version is None or version.slot >= 0 or name in self._retiring or self._waiting:
                return
            slot = self._room_for(version)
            if slot is not None:
                self._place(version, slot)  # False (source gone) is reported by the next acquire

    def note_queued(self, queued: Mapping[str, int]) -> None:
        """The scheduler's queued requests per adapter, once a step: it prices evictions and
        drains, and the aging of waiting adapters is checked here."""
        with self._lock:
            self._queued = queued
            if self._waiting:
                self._rebalance()

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
            self._forget_if_retired(version)
            self._rebalance()

    def slot_queue(self) -> dict[str, float]:
        """Adapters waiting for a slot -> seconds waited so far (for metrics)."""
        with self._lock:
            now = self._clock()
            return {name: now - since for name, since in self._waiting.items()}

    def suspensions(self) -> int:
        return self.num_suspensions

    def requests_suspended(self) -> int:
        with self._lock:
            return sum(v.held for v in (*self._active.values(), *self._retiring.values()))

    def slots_draining(self) -> int:
        with self._lock:
            return len(self._draining)

    # ----- internals (lock held) -----

    def _get(self, name: str) -> _Version:
        version = self._active.get(name)
        if version is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", adapter=name)
        return version

    def _claim(self, version: _Version) -> bool:
        """Make `version` resident and ready for one more request (True), or queue it for a slot."""
        name = version.name
        if version.slot < 0 and name in self._waiting:
            if self._next_waiter() == name:
                self._rebalance()  # the head checks for a slot freed by time (reservations)
            if version.slot < 0:
                return False  # still queued: release and note_queued move the queue
        if version.slot < 0:
            slot = None if self._waiting else self._room_for(version)  # earlier waiters first
            if slot is None:
                self._waiting[name] = self._clock()
                self._rebalance()
                if version.slot < 0:
                    return False
            elif not self._place(version, slot):
                raise AdapterNotFound(
                    f"adapter {name!r} could not be re-read from {version.source}", adapter=name
                )
        if version.refs == 0 and not self._within_share(version):
            # Computing adapters would hold more than the pool's share: wait in the slot queue like an
            # adapter with no slot, so aged waiters drain busy slots for it (no starvation).
            self._waiting.setdefault(name, self._clock())
            self._rebalance()
            return False
        if name in self._waiting and version.slot >= 0:
            self._waiting.pop(name)
        return version.slot not in self._draining and self.pool.ready(version.slot)

    def _within_share(self, version: _Version) -> bool:
        """Pages in the KV cache's memory (lora/unified.py): adapters requests compute with, and
        pinned ones, hold at most the pool's share (`pool.guaranteed_pages`), so the KV cache can
        always reclaim the rest and never gets fewer blocks than beside a separate pool."""
        share = self.pool.guaranteed_pages
        if share is None:
            return True
        held = sum(
            v.pages for v in self._slots if v is not None and (v.refs or v.pinned) and v is not version
        )
        return held + version.pages <= share

    def reclaimable_blocks(self) -> int:
        """KV blocks the idle adapters' pages hold (the KV side counts them as free)."""
        with self._lock:
            pages = sum(
                self.pool.slot_pages(s) for s, v in enumerate(self._slots) if v is not None and self._idle(v)
            )
            return pages * self.run_blocks

    def reclaim_blocks(self, blocks: int) -> None:
        """The KV cache needs `blocks` more: idle adapters go back to the host tier, least recently
        used first, until their pages cover it (never one a request computes with: `refs` > 0)."""
        with self._lock:
            idle = sorted(
                (v.last_used, s) for s, v in enumerate(self._slots) if v is not None and self._idle(v)
            )
            freed = 0
            for _, slot in idle:
                if freed >= blocks:
                    break
                freed += self.pool.slot_pages(slot) * self.run_blocks
                self._draining.discard(slot)
                self._evict(slot)
                self.num_reclaims += 1

    @staticmethod
    def _idle(v: _Version) -> bool:
        return not v.refs and not v.pinned

    def _forget_if_retired(self, version: _Version) -> None:
        if version.refs == 0 and version.held == 0 and self._retiring.get(version.name) is version:
            del self._retiring[version.name]
            self._drop(version)

    def _version_of(self, name: str) -> _Version | None:
        """The version a request of `name` would compute on: the retiring one while it has requests."""
        return self._retiring.get(name) or self._active.get(name)

    def _retire(self, version: _Version) -> None:
        if version.refs == 0 and version.held == 0:
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
            self.pool.release(version.slot)
            version.slot = -1
        version.weights = None

    def _vocab_allowed(self, version: _Version | None) -> set[int] | None:
        """The slots `version` may take: any (None), or, for an adapter needing a vocab slot while
        none is free, those whose occupant holds one (replacing it frees it)."""
        if version is None or not version.vocab or self.pool.vocab.free_vocab_slot():
            return None
        return self.pool.vocab.holders()

    def _room_for(self, version: _Version) -> int | None:
        """A slot `version` can be uploaded into with enough free pages, or None. The slot is
        `evictable_slot`'s choice; when the free pages (with that slot's own) fall short, further idle
        adapters are evicted, cheapest first (`idle_slots`), but only if that makes room: an adapter
        a request computes on (refs > 0), a pinned, reserved or draining one is never evicted."""
        now = self._clock()
        allowed = self._vocab_allowed(version)
        slot = evictable_slot(self._slots, self._queued, self._draining, now, allowed)
        if slot is None:
            return None
        returned = self.pool.slot_pages(slot)
        evict: list[int] = []
        for other in idle_slots(self._slots, self._queued, self._draining, now):
            if self.pool.pages_available(returned) >= version.pages:
                break
            if other != slot:
                evict.append(other)
                returned += self.pool.slot_pages(other)
        if self.pool.pages_available(returned) < version.pages:
            return None
        for other in evict:
            self._evict(other)
        return slot

    def _evict(self, slot: int) -> None:
        """Send an idle slot's adapter back to the host tier and free its pages."""
        occupant = self._slots[slot]
        if occupant is not None:
            occupant.slot = -1
            self._evictions[occupant.name] = self._evictions.get(occupant.name, 0) + 1
        self._slots[slot] = None
        self.pool.release(slot)

    def _drainable_slots(self, count: int, max_popularity: float | None = None) -> list[int]:
        placed_before = self._clock() - self.min_resident_s
        return cheapest_busy_slots(
            self._slots, self._queued, self._draining, count, placed_before, max_popularity
        )

    def _place(self, version: _Version, slot: int) -> bool:
        """Upload `version` into `slot`, evicting its occupant (refcount 0). False if unreadable."""
        weights = version.weights
        tally = self._host_hits if weights is not None else self._host_misses
        tally[version.name] = tally.get(version.name, 0) + 1
        if weights is None:
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
                return False
            version.weights = weights
        occupant = self._slots[slot]
        if occupant is not None:
            occupant.slot = -1
            self._evictions[occupant.name] = self._evictions.get(occupant.name, 0) + 1
        self.pool.upload(slot, weights)
        self.num_uploads += 1
        self.upload_bytes += version.nbytes
        version.uploads += 1
        self._slots[slot] = version
        version.slot = slot
        version.placed_at = self._clock()
        version.reserved_until = version.placed_at + RESERVE_S
        self._trim_host_cache(keep=version)  # its request takes a reference right after
        return True

    def _rebalance(self) -> None:
        """Serve waiting adapters from evictable slots, then drain busy slots for aged waiters."""
        self._serve_waiters()
        now = self._clock()
        aged = [n for n, since in self._waiting.items() if since <= now - self.slot_wait_s]
        need = min(len(aged), self.max_draining) - len(self._draining)
        if need > 0:
            # Aged waiters drain only adapters no more popular than the most popular of them (its
            # waiting request counted), so the hot set stays resident while colder slots rotate;
            # when every unpinned slot holds a more popular adapter, the least popular drains.
            ceiling: float | None = max(
                popularity_after(v.popularity, now) for n in aged if (v := self._version_of(n)) is not None
            )
            if not any(v is not None and not v.pinned and v.popularity <= ceiling for v in self._slots):
                ceiling = None
            for slot in self._drainable_slots(need, ceiling):
                self._draining.add(slot)
        # An aged waiter that needs a vocab slot while none is free drains a vocab-holding slot.
        holders = self.pool.vocab.holders()
        blocked = any(self._vocab_allowed(self._version_of(n)) is not None for n in aged)
        if blocked and not holders & self._draining and len(self._draining) < self.max_draining:
            placed_before = now - self.min_resident_s
            for slot in cheapest_busy_slots(
                self._slots, self._queued, self._draining, 1, placed_before, allowed=holders
            ):
                self._draining.add(slot)

    def _serve_waiters(self) -> None:
        """Place waiting adapters into evictable slots, in queue order. One that needs a vocab slot
        while none can be had is passed over (it keeps its place); one that needs a plain slot while
        none is evictable stops the pass (nothing after it can be placed either)."""
        progressed = True
        while progressed and self._waiting:
            progressed = False
            order = sorted(
                self._waiting, key=lambda n: self._waiting[n] - self.queued_credit_s * self._queued.get(n, 0)
            )
            for name in order:
                version = self._version_of(name)
                retiring_idle = (
                    version is not None and version is self._retiring.get(name) and not version.held
                )
                if (
                    version is not None
                    and version.slot >= 0
                    and not version.refs
                    and not self._within_share(version)
                ):
                    return  # resident, waiting for the share (unified memory): only a drain helps it
                if version is None or version.slot >= 0 or retiring_idle:
                    self._waiting.pop(name)
                    progressed = True
                    break
                slot = self._room_for(version)
                if slot is None:
                    if self._vocab_allowed(version) is not None:
                        continue
                    return
                self._waiting.pop(name)
                self._place(version, slot)
                progressed = True
                break

    def _next_waiter(self) -> str:
        return next_waiter(self._waiting, self._queued, self.queued_credit_s)

    def _trim_host_cache(self, keep: _Version | None = None) -> None:
        """Apply the host tier's bounds (lora/host_tier.py): dropped copies are re-read when needed."""
        held = [v for v in (*self._active.values(), *self._retiring.values()) if v.weights is not None]
        for v in copies_to_drop(held, self.max_loaded_loras, self.max_cpu_lora_bytes, keep):
            v.weights = None

    def host_bytes(self) -> int:
        """Bytes of adapter weights held in host memory (the host tier)."""
        with self._lock:
            versions = (*self._active.values(), *self._retiring.values())
            return sum(v.nbytes for v in versions if v.weights is not None)

    def _info(self, v: _Version) -> AdapterInfo:
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
