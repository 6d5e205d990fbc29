"""The LoRA manager's slot residency: which adapter version sits in which GPU slot, on whose pages.

Contract (a mixin of `LoRAManager`, lora/manager.py, which owns the state and the one lock):
- A slot is freed or re-used only when no request computes on it (`refs` 0). A request that
  gave its slot up (`suspend`: the scheduler keeps its KV) still holds its version (`held`), so a
  version is dropped only with `refs` and `held` both 0 (lora/adapter_registry.py).
- Placement (`_room_for`): the slot is slot_choice.evictable_slot's choice; an adapter takes pages
  of its own rank (lora/pool.py), and a placement short of free pages evicts further idle
  adapters, cheapest first, only if that makes room. An adapter a request computes on, a pinned,
  reserved or draining one is never evicted.
- Vocab slots (lora/vocab_tables.py): an adapter with vocabulary parts is placed only into a slot
  where one is free or whose evicted occupant frees one (`_vocab_allowed`).
- Unified memory (lora/unified.py): adapters requests compute with, and pinned ones, hold at most
  the pool's share (`_within_share`); the KV cache reclaims idle adapters' pages (`reclaim_blocks`).
- An adapter refused a slot joins the slot queue; serving it and draining busy slots is
  lora/slot_rotation.py (`_rebalance`).
- `acquire`/`resume`/`release`/`suspend`/`prefetch` run on the engine thread: they write the pool,
  ordered on its compute stream. Methods named `_x` expect the manager's lock held.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from loraplex.services.inference.errors import AdapterNotFound
from loraplex.services.inference.lora.adapter_registry import AdapterVersion
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.slot_choice import evictable_slot, idle_slots, popularity_after

log = logging.getLogger(__name__)

# A slot handed to a waiting adapter is kept for it this long even before its request takes it.
RESERVE_S = 2.0


class SlotResidency:
    """Refcounted slots of one `AdapterPool` (the manager's state it reads and writes is listed here)."""

    pool: AdapterPool
    max_loras_per_batch: int | None
    _clock: Callable[[], float]
    _lock: threading.RLock
    _active: dict[str, AdapterVersion]
    _retiring: dict[str, AdapterVersion]
    _slots: list[AdapterVersion | None]
    _waiting: OrderedDict[str, float]
    _draining: set[int]
    _queued: Mapping[str, int]
    _evictions: dict[str, int]
    num_uploads: int
    upload_bytes: int
    num_suspensions: int
    num_reclaims: int
    run_blocks: int
    # From the other parts of the manager: `_get`, `_forget_if_retired`, `_weights_for_upload`,
    # `_trim_host_cache` (lora/adapter_registry.py); `_rebalance`, `_next_waiter` (lora/slot_rotation.py).

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

    def suspensions(self) -> int:
        return self.num_suspensions

    def requests_suspended(self) -> int:
        with self._lock:
            return sum(v.held for v in (*self._active.values(), *self._retiring.values()))

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

    # ----- internals (lock held) -----

    def _claim(self, version: AdapterVersion) -> bool:
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

    def _within_share(self, version: AdapterVersion) -> bool:
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

    @staticmethod
    def _idle(v: AdapterVersion) -> bool:
        return not v.refs and not v.pinned

    def _drop(self, version: AdapterVersion) -> None:
        """A version leaves for good (retired, unloaded): its slot and its host copy go."""
        if version.slot >= 0:
            self._draining.discard(version.slot)
            self._slots[version.slot] = None
            self.pool.release(version.slot)
            version.slot = -1
        version.weights = None

    def _vocab_allowed(self, version: AdapterVersion | None) -> set[int] | None:
        """The slots `version` may take: any (None), or, for an adapter needing a vocab slot while
        none is free, those whose occupant holds one (replacing it frees it)."""
        if version is None or not version.vocab or self.pool.vocab.free_vocab_slot():
            return None
        return self.pool.vocab.holders()

    def _room_for(self, version: AdapterVersion) -> int | None:
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
            return None  # evicting would not make room: keep the idle adapters resident
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

    def _place(self, version: AdapterVersion, slot: int) -> bool:
        """Upload `version` into `slot`, evicting its occupant (refcount 0). False if unreadable."""
        weights = self._weights_for_upload(version)
        if weights is None:
            return False
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
