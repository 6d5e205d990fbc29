"""The LoRA manager's slot queue and rotation: which waiting adapter gets a slot next, and which
busy slots drain for the waiters.

Contract (a mixin of `LoRAManager`, lora/manager.py, which owns the state and the one lock; the
choices themselves are slot_choice.py's pure functions):
- Admission without a cliff: a slot is a scheduling resource, not a request limit. An adapter
  refused a slot waits in `_waiting`, served longest-waiting first where each queued request counts
  as `queued_credit_s` of waiting (every waiter ages to the front).
- Once a waiter has waited `slot_wait_s`, busy slots drain for the aged waiters (at most
  `max_draining` at once): a draining slot takes no new requests and the scheduler suspends the
  requests on it (`yielding`), so it frees at the next step. Only slots placed `min_resident_s` ago
  drain (the quantum), least popular first, and only adapters no more popular than the most
  popular aged waiter unless every slot holds a hotter one. Pinned slots never drain.
- Bound: the queue's front gets a slot within `slot_wait_s` + `min_resident_s` + 2 steps
  (docs/architecture.md, "LoRA manager", states the rest).
- A waiter needing a vocab slot while none can be had keeps its place while later ones are served;
  once aged it drains a busy vocab-holding slot.
Methods named `_x` expect the manager's lock held.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from loraplex.services.inference.lora.adapter_registry import AdapterVersion
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.slot_choice import cheapest_busy_slots, next_waiter, popularity_after

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


class SlotRotation:
    """The slot queue and its drains (the manager's state it reads and writes is listed here)."""

    pool: AdapterPool
    slot_wait_s: float
    min_resident_s: float
    queued_credit_s: float
    max_draining: int
    _clock: Callable[[], float]
    _lock: threading.RLock
    _retiring: dict[str, AdapterVersion]
    _slots: list[AdapterVersion | None]
    _waiting: OrderedDict[str, float]
    _draining: set[int]
    _queued: Mapping[str, int]
    # From the other parts of the manager: `_version_of` (lora/adapter_registry.py); `_room_for`,
    # `_place`, `_within_share`, `_vocab_allowed` (lora/slot_residency.py).

    def yielding(self) -> frozenset[str]:
        """Adapters whose slot drains for a waiting adapter: their running requests should suspend."""
        with self._lock:
            return frozenset(v.name for s in self._draining if (v := self._slots[s]) is not None and v.refs)

    def note_queued(self, queued: Mapping[str, int]) -> None:
        """The scheduler's queued requests per adapter, once a step: it prices evictions and
        drains, and the aging of waiting adapters is checked here."""
        with self._lock:
            self._queued = queued
            if self._waiting:
                self._rebalance()

    def slot_queue(self) -> dict[str, float]:
        """Adapters waiting for a slot -> seconds waited so far (for metrics)."""
        with self._lock:
            now = self._clock()
            return {name: now - since for name, since in self._waiting.items()}

    def slots_draining(self) -> int:
        with self._lock:
            return len(self._draining)

    # ----- internals (lock held) -----

    def _drainable_slots(self, count: int, max_popularity: float | None = None) -> list[int]:
        placed_before = self._clock() - self.min_resident_s
        return cheapest_busy_slots(
            self._slots, self._queued, self._draining, count, placed_before, max_popularity
        )

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
