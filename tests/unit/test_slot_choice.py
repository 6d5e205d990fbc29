"""lora/slot_choice.py on plain records: which slot is given up, which waiter goes first, which busy
slots drain. The manager's behaviour over time is tests/unit/test_lora_manager.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from loraplex.services.inference.lora.slot_choice import (
    cheapest_busy_slots,
    evictable_slot,
    next_waiter,
    popularity_after,
)


@dataclass
class Held:
    name: str
    refs: int = 0
    pinned: bool = False
    last_used: float = 0.0
    reserved_until: float = 0.0
    placed_at: float = 0.0
    popularity: float = 0.0


def test_an_empty_slot_goes_first_whatever_the_others_cost():
    slots = [Held("a", last_used=1.0), None, Held("b")]
    assert evictable_slot(slots, {}, set(), now=5.0) == 1


def test_the_idle_slot_with_fewest_queued_requests_then_least_recently_used_is_evicted():
    slots = [Held("hot", last_used=1.0), Held("cold-new", last_used=4.0), Held("cold-old", last_used=3.0)]
    assert evictable_slot(slots, {"hot": 5}, set(), now=10.0) == 2
    assert evictable_slot(slots, {"hot": 5, "cold-old": 1}, set(), now=10.0) == 1


def test_busy_pinned_draining_and_reserved_slots_are_never_evicted():
    slots = [
        Held("running", refs=1),
        Held("pinned", pinned=True),
        Held("draining"),
        Held("reserved", reserved_until=11.0),
    ]
    assert evictable_slot(slots, {}, {2}, now=10.0) is None
    assert evictable_slot(slots, {}, {2}, now=11.0) == 3  # the reservation has run out


def test_each_queued_request_counts_as_slot_wait_s_of_waiting():
    waiting = {"cold": 100.0, "popular": 102.5}  # name -> since when it waits
    assert next_waiter(waiting, {}, slot_wait_s=1.0) == "cold"
    assert next_waiter(waiting, {"popular": 2}, slot_wait_s=1.0) == "cold"  # 2 requests < 2.5 s later
    assert next_waiter(waiting, {"popular": 3}, slot_wait_s=1.0) == "popular"


def test_drains_take_the_busy_slots_whose_loss_costs_least():
    slots = [
        Held("hot", refs=1),
        Held("idle"),  # not busy: it needs no drain, it can be evicted
        Held("pinned", refs=1, pinned=True),
        Held("one-running", refs=1, last_used=5.0),
        Held("two-running", refs=2),
        Held("already", refs=1),
    ]
    queued = {"hot": 3}
    assert cheapest_busy_slots(slots, queued, {5}, count=2) == [3, 4]
    assert cheapest_busy_slots(slots, queued, {5}, count=9) == [3, 4, 0]


def test_popularity_is_a_decayed_request_count_that_compares_without_decaying():
    one_now = popularity_after(-float("inf"), 20.0, half_life_s=10.0)
    two_then = popularity_after(popularity_after(-float("inf"), 10.0, 10.0), 10.0, 10.0)
    # two requests one half-life ago weigh as one request now
    assert two_then == pytest.approx(one_now)
    three_then = popularity_after(two_then, 10.0, 10.0)
    assert three_then > one_now > popularity_after(-float("inf"), 0.0, 10.0)
    # busy slots drain least popular first, and a ceiling keeps the more popular
    slots = [Held("hot", refs=3, popularity=5.0), Held("cold", refs=1, popularity=1.0, last_used=9.0)]
    assert cheapest_busy_slots(slots, {}, set(), 1) == [1]
    assert cheapest_busy_slots(slots, {}, set(), 2, max_popularity=2.0) == [1]
    assert cheapest_busy_slots(slots, {}, set(), 2, placed_before=-1.0) == []
