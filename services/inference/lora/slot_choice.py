"""Which slot to give up and which waiting adapter to serve: LoRAManager's choices, as pure functions.

Each reads the slot table (a version per slot, or None), the scheduler's last report of queued
requests per adapter and the set of draining slots; none changes anything, so the manager keeps
every write under its lock and these stay testable with plain records."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

# Half-life of an adapter's popularity: a request counts half as much this many seconds later.
POPULARITY_HALF_LIFE_S = 10.0


def popularity_after(popularity: float, now: float, half_life_s: float = POPULARITY_HALF_LIFE_S) -> float:
    """`popularity` plus one request at `now`. Kept as log2 of the decayed request count plus
    now / half-life, so scores of different adapters compare without decaying each of them: at
    any moment the higher score is the adapter with more (recency-weighted) requests."""
    event = now / half_life_s
    hi, lo = max(popularity, event), min(popularity, event)
    return hi + math.log2(1.0 + 2.0 ** (lo - hi)) if lo > -math.inf else hi


class SlotHolder(Protocol):
    """What the choices read of an adapter version in a slot."""

    name: str
    refs: int  # running requests on it
    pinned: bool
    last_used: float
    reserved_until: float  # a slot handed to a waiter is kept for it until then
    placed_at: float  # when it was uploaded into its slot
    popularity: float  # its requests' recent rate, as `popularity_after` keeps it (higher: hotter)


def evictable_slot(
    slots: Sequence[SlotHolder | None],
    queued: Mapping[str, int],
    draining: set[int],
    now: float,
    allowed: Collection[int] | None = None,
) -> int | None:
    """An empty slot, else the idle (refcount 0, unpinned, unreserved, not draining) slot whose
    adapter has the fewest queued requests, then is least popular, then least recently used; None
    when every slot is busy. `allowed`: only these slots (None: any)."""
    for slot, v in enumerate(slots):
        if allowed is not None and slot not in allowed:
            continue
        if v is None:
            return slot
    idle = [s for s in idle_slots(slots, queued, draining, now) if allowed is None or s in allowed]
    return idle[0] if idle else None


def idle_slots(
    slots: Sequence[SlotHolder | None], queued: Mapping[str, int], draining: set[int], now: float
) -> list[int]:
    """The occupied idle slots in the order `evictable_slot` gives them up (cheapest first): an upload
    short of free pages evicts these, in this order, until its pages fit."""
    keyed = [
        ((queued.get(v.name, 0), v.popularity, v.last_used), slot)
        for slot, v in enumerate(slots)
        if v is not None and not (v.refs or v.pinned or slot in draining or v.reserved_until > now)
    ]
    return [slot for _, slot in sorted(keyed)]


def next_waiter(waiting: Mapping[str, float], queued: Mapping[str, int], slot_wait_s: float) -> str:
    """The waiting adapter served next: the longest waiting, where each queued request counts as
    `slot_wait_s` of waiting (a popular adapter overtakes cold ones; a cold one still ages to the
    front, as a later arrival must have more queued requests than seconds since).
    `waiting` maps a name to when it started waiting."""
    return min(waiting, key=lambda n: waiting[n] - slot_wait_s * queued.get(n, 0))


def cheapest_busy_slots(
    slots: Sequence[SlotHolder | None],
    queued: Mapping[str, int],
    draining: set[int],
    count: int,
    placed_before: float | None = None,
    max_popularity: float | None = None,
    allowed: Collection[int] | None = None,
) -> list[int]:
    """Up to `count` busy unpinned slots, not yet draining (and placed no later than `placed_before`,
    when given: a fresh upload keeps its slot for a quantum; and no more popular than
    `max_popularity`, when given), whose loss costs least: fewest queued
    requests, then least popular (the hot set stays resident), then fewest running, then least
    recently used. `allowed`: only these slots (None: any)."""
    busy = [
        ((v.popularity, queued.get(v.name, 0), v.refs, v.last_used), s)
        for s, v in enumerate(slots)
        if v is not None
        and v.refs
        and not v.pinned
        and s not in draining
        and (placed_before is None or v.placed_at <= placed_before)
        and (max_popularity is None or v.popularity <= max_popularity)
        and (allowed is None or s in allowed)
    ]
    return [s for _, s in sorted(busy)[:count]]
