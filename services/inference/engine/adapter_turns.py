"""Which adapters may compute in a step under `--max-loras-per-batch K` (the scheduler's policy).

The cap bounds the distinct adapters of one step, not which adapters are resident: the GPU pool
is sized from memory, so an adapter left out of a step keeps its slot, its running requests keep
their KV, and they go on at its next step without an upload. The policy, in three sentences:

1. Hot places: `K - C` places belong to the adapters with the most requests (running + queued),
   and a hot adapter keeps its place for as long as it has any request.
2. Turns: the other adapters with requests queue for the `C` turn places in arrival order; a turn
   lasts `quantum` steps, in which the adapter's whole queue is admitted (as KV allows) and its
   running requests decode; then it goes to the back of the queue if it still has requests.
3. Bound: an adapter with requests computes within `ceil(A / C) * quantum` steps, A being the
   adapters in the turn queue (itself included); base requests take no place and never wait.

Why time slices and not slot drains: with Zipf traffic the hottest K adapters have requests
nearly always, so a rule that waits for an adapter's requests to finish before giving its place
away either starves the cold adapters or (draining hot ones) takes the hot adapters' places; a
step-sized turn lets both run. The price is the cold adapters' decode speed (their requests
advance only in their turns), not their time to first token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from services.inference.engine.request import Request

# Steps one turn lasts. Short turns keep the wait bound short (a request's first token needs one
# turn); each turn still admits the adapter's whole queue, so short turns cost no batching.
TURN_STEPS = 4


def adapter_work(running: Iterable[Request], waiting: Iterable[Request]) -> Counter[str]:
    """Requests per adapter, running and queued, in order of first appearance (running first)."""
    work: Counter[str] = Counter()
    for group in (running, waiting):
        for req in group:
            if req.adapter is not None:
                work[req.adapter] += 1
    return work


class AdapterTurns:
    """Hot places plus rotating turns (module docstring). `select` is called once per step."""

    def __init__(self, cap: int, *, turn_places: int | None = None, quantum: int = TURN_STEPS):
        if cap < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1 (got {cap})")
        self.cap = cap
        # Half the places rotate: with Zipf popularity the hottest few carry most requests, and the
        # turn places are what bounds every other adapter's wait.
        self.turn_places = min(cap, turn_places if turn_places is not None else max(1, cap // 2))
        self.hot_places = cap - self.turn_places
        self.quantum = quantum
        self.hot: list[str] = []
        self.turns: dict[str, int] = {}  # holder -> steps left in its turn
        self.queue: dict[str, None] = {}  # adapters waiting for a turn, in arrival order

    def wait_bound_steps(self, queued_adapters: int) -> int:
        """Steps within which an adapter that is one of `queued_adapters` in the turn queue computes."""
        return math.ceil(queued_adapters / self.turn_places) * self.quantum

    def select(self, running: Iterable[Request], waiting: Iterable[Request]) -> frozenset[str]:
        """The adapters whose requests may compute this step (at most `cap`)."""
        work = adapter_work(running, waiting)
        self.hot = [a for a in self.hot if work[a]]
        for name in list(self.turns):
            if not work[name]:
                del self.turns[name]
            elif self.turns[name] <= 0:  # turn over: to the back of the queue
                del self.turns[name]
                self.queue[name] = None
        for name in [n for n in self.queue if not work[n]]:
            del self.queue[name]
        placed = set(self.hot) | set(self.turns)
        for name in work:
            if name not in placed and name not in self.queue:
                self.queue[name] = None
        while len(self.hot) < self.hot_places and (self.queue or self.turns):
            # max() keeps the first of equals: the longest-queued adapter among the busiest
            best = max([*self.queue, *self.turns], key=lambda n: work[n])
            self.queue.pop(best, None)
            self.turns.pop(best, None)
            self.hot.append(best)
        while len(self.turns) < self.turn_places and self.queue:
            name = next(iter(self.queue))
            del self.queue[name]
            self.turns[name] = self.quantum
        for name in self.turns:
            self.turns[name] -= 1
        return frozenset(self.hot) | frozenset(self.turns)


class DemandSlices:
    """The policy compared against (demand-weighted time slices, stride scheduling): each step runs
    the K adapters with the lowest pass; a run advances an adapter's pass by 1 / (its requests), and
    an adapter that gets requests starts at the lowest pass of those with requests."""

    def __init__(self, cap: int):
        self.cap = cap
        self.passes: dict[str, float] = {}

    def select(self, running: Iterable[Request], waiting: Iterable[Request]) -> frozenset[str]:
        work = adapter_work(running, waiting)
        self.passes = {n: p for n, p in self.passes.items() if work[n]}
        floor = min(self.passes.values(), default=0.0)
        for name in work:
            self.passes.setdefault(name, floor)
        chosen = sorted(work, key=lambda n: (self.passes[n], -work[n]))[: self.cap]
        for name in chosen:
            self.passes[name] += 1.0 / work[name]
        return frozenset(chosen)
