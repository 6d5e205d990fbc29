"""The scheduler's side of the adapter slots: which slot each request of an adapter holds.

A request of an adapter computes only on a slot of the LoRA pool (lora/adapter_slots.py decides
which adapter gets which slot, and when). The scheduler asks here, per request: `acquire` on
admission, `release` when the request ends; a preempted request keeps its slot (it resumes on the
adapter version it started with). When the slots drain a slot for a waiting adapter
(`AdapterSlots.yielding`), `yield_wanted` suspends the requests on it at the start of the step:
they keep their KV and adapter version, give the slot up, sit out, and `resume` on whichever slot
they get next. `prefetch` starts uploading the adapters of the next queued requests so they are
resident by the time those are admitted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.errors import LoraplexError
from loraplex.services.inference.lora.adapter_slots import AdapterSlots

# How far down the waiting queue the scheduler looks for adapters to upload ahead of time.
PREFETCH_WINDOW = 64


class RequestSlots:
    """`acquire` and `resume` answer True (the request holds a slot now), None (not yet: it sits
    out, and its adapter is added to the step's `refused` set so its other requests do not ask
    again) or False (the adapter failed: the request was finished with the error, through
    `finish`, the scheduler's)."""

    def __init__(self, adapter_slots: AdapterSlots, finish: Callable[[Request, str, Exception], None]):
        self.adapter_slots = adapter_slots
        self._finish = finish

    def acquire(self, req: Request, refused: set[str]) -> bool | None:
        """A slot for a request admitted for the first time (or preempted before its adapter had one)."""
        return self._take(req, refused, self.adapter_slots.acquire)

    def resume(self, req: Request, refused: set[str]) -> bool | None:
        """A slot again for a suspended request."""
        if req.adapter in refused:
            return None
        took = self._take(req, refused, self.adapter_slots.resume)
        if took:
            req.lora_suspended = False
        return took

    def _take(self, req: Request, refused: set[str], take: Callable[[str], int | None]) -> bool | None:
        try:
            slot = take(req.adapter)  # type: ignore[arg-type]
        except LoraplexError as exc:
            self._finish(req, "abort", exc)
            return False
        if slot is None:
            refused.add(req.adapter)  # type: ignore[arg-type]
            return None  # not resident yet: others go first
        req.lora_slot = slot
        return True

    def release(self, req: Request) -> None:
        """The request's hold on its adapter goes (it ended, or gives back a slot it just took)."""
        if req.lora_slot >= 0 and req.adapter is not None:
            self.adapter_slots.release(req.adapter)
        elif req.lora_suspended and req.adapter is not None:
            self.adapter_slots.release_suspended(req.adapter)
        req.lora_slot = -1
        req.lora_suspended = False

    def yield_wanted(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        """Requests on slots wanted by waiting adapters (AdapterSlots.yielding) give them up: they
        keep their KV and adapter version, and sit out until `resume` hands them a slot."""
        wanted = self.adapter_slots.yielding()
        if not wanted:
            return
        for req in itertools.chain(running, waiting):
            if req.adapter in wanted and req.lora_slot >= 0:
                self.adapter_slots.suspend(req.adapter)
                req.lora_slot = -1
                req.lora_suspended = True

    def prefetch(self, waiting: Iterable[Request]) -> None:
        """Start uploading the adapters of the next queued requests, so they are resident by the
        time those requests are admitted (the copy overlaps this step's forward)."""
        limit = self.adapter_slots.slots_total()
        seen: set[str] = set()
        for req in itertools.islice(waiting, PREFETCH_WINDOW):
            if len(seen) >= limit:
                break
            if (
                req.adapter is not None
                and req.lora_slot < 0
                and not req.lora_suspended
                and req.adapter not in seen
            ):
                seen.add(req.adapter)
                self.adapter_slots.prefetch(req.adapter)
