"""Which adapters may compute in a step under `--max-loras-per-batch K` (the scheduler's policy).

The cap bounds the distinct adapters of one step, not which adapters are resident: the GPU pool
is sized from memory, so an adapter left out of a step keeps its slot, its running requests keep
their KV, and they go on at its next step without an upload. The policy (demand-weighted time
slices, stride scheduling over adapters), in three sentences:

1. Hot adapters, each holding at least 1/K of the requests (running + queued), compute every
   step; the other places go to the adapters with requests whose *pass* is lowest, computing
   advances an adapter's pass by 1 / (its requests), and an adapter that gets requests starts at
   the lowest pass, so its share of steps follows its demand and its first step comes at once.
2. A place is a whole adapter: a chosen adapter's running requests decode and its whole queue is
   admitted in that step (as KV and the token budget allow), so its requests batch together.
3. Bound: an adapter that has waited `max_wait` steps takes the next free place (longest waiting
   first), and at least one place is never hot, so none with requests waits more than
   `max_wait + A` steps, A being the adapters with requests when it started waiting (in practice
   `max_wait + ceil(A / (K - hot))`); base requests take no place and never wait.

Measured against the policy the issue first proposed (K/2 places kept by the hottest adapters
while they have requests, K/2 turn places rotating over the rest in arrival order, 4 steps a
turn) on a virtual clock (docs/benchmarks.md, "Scarce slots"): turns advance cold
requests only in their turns, so they pile up; 64 Zipf adapters on 8, TTFT p99 8.7x base and
the 8 hottest 7.8x, against 3.7x and 1.4x here. Why time slices at all, not slot drains: with Zipf
traffic the hottest K adapters have requests nearly always, so waiting for an adapter's requests
to finish before giving its place away starves either the cold adapters or the hot ones.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from loraplex.services.inference.engine.request import Request

# Steps an adapter with requests may go without computing before it goes first. Waits are short
# without it (a new adapter starts at the lowest pass); this is the guarantee. About 0.25 s of
# 8 ms decode steps.
MAX_WAIT_STEPS = 32


def adapter_work(running: Iterable[Request], waiting: Iterable[Request]) -> Counter[str]:
    """Requests per adapter, running and queued, in order of first appearance (running first)."""
    work: Counter[str] = Counter()
    for group in (running, waiting):
        for req in group:
            if req.adapter is not None:
                work[req.adapter] += 1
    return work


class DemandSlices:
    """Demand-weighted time slices with a wait bound (module docstring). `select` runs once a step."""

    def __init__(self, cap: int, *, max_wait: int = MAX_WAIT_STEPS):
        if cap < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1 (got {cap})")
        self.cap = cap
        self.max_wait = max_wait
        self.passes: dict[str, float] = {}
        self.waited: dict[str, int] = {}  # steps since the adapter last computed (or got requests)

    def wait_bound_steps(self, adapters_with_requests: int, hot: int = 0) -> int:
        """The most steps an adapter waits to compute, given the adapters with requests when it
        started waiting (itself included) and how many of them at most are hot meanwhile (< cap;
        the cap - 1 that can be, by default)."""
        free = self.cap - hot if hot else 1
        return self.max_wait + math.ceil(adapters_with_requests / free)

    @staticmethod
    def hot(work: Counter[str], cap: int) -> list[str]:
        """Adapters holding at least 1/cap of the requests (at most cap - 1 unless they hold them all)."""
        total = sum(work.values())
        return [n for n in work if work[n] * cap >= total]

    def select(self, running: Iterable[Request], waiting: Iterable[Request]) -> frozenset[str]:
        """The adapters whose requests may compute this step (at most `cap`)."""
        waiting = list(waiting)
        work = adapter_work(running, waiting)
        queued = adapter_work((), waiting)
        self.passes = {n: p for n, p in self.passes.items() if work[n]}
        self.waited = {n: w for n, w in self.waited.items() if work[n]}
        floor = min(self.passes.values(), default=0.0)
        for name in work:
            self.passes.setdefault(name, floor)
            self.waited.setdefault(name, 0)
        chosen = self.hot(work, self.cap)[: self.cap]
        taken = set(chosen)
        aged = [n for n in work if n not in taken and self.waited[n] >= self.max_wait]
        chosen += sorted(aged, key=lambda n: -self.waited[n])[: self.cap - len(chosen)]
        if len(chosen) < self.cap:
            taken = set(chosen)
            # equal passes: first tokens owed (queued requests) first, then the busier adapter
            rest = sorted(
                (n for n in work if n not in taken), key=lambda n: (self.passes[n], -queued[n], -work[n])
            )
            chosen += rest[: self.cap - len(chosen)]
        for name in work:
            self.waited[name] += 1
        for name in chosen:
            self.passes[name] += 1.0 / work[name]
            self.waited[name] = 0
        return frozenset(chosen)
