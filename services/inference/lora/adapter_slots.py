"""The scheduler's view of adapter slots (which adapters may run in this step's batch) and what the
LoRA manager reports of an adapter. Both live beside the manager, so the LoRA package does not
import the engine that uses it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from loraplex.services.inference.errors import AdapterNotFound


@dataclass
class AdapterInfo:
    """What the engine knows about one adapter (for ListAdapters)."""

    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    location: str  # "gpu" | "host" | "store"
    pinned: bool = False
    requests_in_flight: int = 0
    source: str = ""
    digest: str = ""
    slot: int = -1
    evictions: int = 0  # times this adapter's GPU slot was given to another adapter
    uploads: int = 0  # times this adapter was copied into a GPU slot
    host_hits: int = 0  # uploads served from its host copy (the host tier)
    host_misses: int = 0  # uploads that re-read it from its source first (dropped from the host tier)
    nbytes: int = 0  # of its weights (what one upload copies)
    queued_requests: int = 0  # its requests waiting in the scheduler (as of the last step)
    slot_wait_s: float = 0.0  # how long it has been waiting for a GPU slot (0: not waiting)


class AdapterSlots(ABC):
    """Hands out GPU adapter slots to requests (implemented by the LoRA manager).

    Contract:
    - `acquire(name)` returns the slot index (0 <= slot < the pool's slots) holding
      `name` and takes one reference on it, or `None` when the adapter is not resident yet
      (an upload may have been started); the scheduler then skips the request for this step
      and tries again later. It raises AdapterNotFound (or another LoraplexError) when the
      adapter can never be served; the scheduler fails that request with the error.
    - `release(name)` drops one reference taken by `acquire`; a slot with no references may
      be reused for another adapter. The scheduler holds a request's reference from admission
      to finish or abort, across preemptions and suspensions, so a request never changes
      adapter version.
    - Both are called only from the engine thread, between forward passes.
    - `None` holds back only requests of that adapter: the scheduler keeps admitting other
      adapters' and base requests behind them (a slot is a scheduling resource, not a request limit).
    - Residency follows the scheduler: each step the scheduler asks `yielding()` which adapters'
      slots are wanted by waiting adapters, and calls `suspend(name)` for each request holding one
      (it keeps its KV and its adapter version, not the slot; it sits out). A suspended request
      calls `resume(name)` (like `acquire`: a slot index, any one, or None) until it runs again,
      or `release_suspended(name)` when it ends first. Implementations that never yield need
      none of these.
    """

    @abstractmethod
    def acquire(self, adapter_name: str) -> int | None: ...

    @abstractmethod
    def release(self, adapter_name: str) -> None: ...

    def yielding(self) -> frozenset[str]:
        """Adapters whose running requests should suspend this step (their slot is wanted)."""
        return frozenset()

    def suspend(self, adapter_name: str) -> None:
        raise NotImplementedError("this AdapterSlots never yields a slot")

    def resume(self, adapter_name: str) -> int | None:
        raise NotImplementedError("this AdapterSlots never yields a slot")

    def release_suspended(self, adapter_name: str) -> None:
        raise NotImplementedError("this AdapterSlots never yields a slot")

    def prefetch(self, adapter_name: str) -> None:  # noqa: B027 - an optional hint, a no-op by default
        """A hint: a queued request will need `adapter_name` soon; start its upload if a slot is idle.

        Never raises and never takes a reference; `acquire` stays the only way in."""

    def content_digest(self, adapter_name: str) -> str | None:
        """The content digest of the version `acquire(adapter_name)` would hand out now (None: unknown).

        A hint: the version may change before `acquire`; `slot_digest` is the authority."""
        return None

    def slot_digest(self, slot: int) -> str | None:
        """The content digest of the adapter version in `slot` while a reference from `acquire` is
        held on it (None: unknown). The prefix cache keys KV by it, never by a name; None means
        that request's KV is neither cached nor reused."""
        return None

    def note_queued(self, queued: Mapping[str, int]) -> None:  # noqa: B027 - optional, a no-op by default
        """Once a step: how many requests wait in the scheduler's queue per adapter (prices evictions)."""

    def batch_cap(self) -> int | None:
        """`--max-loras-per-batch`: the most distinct adapters one step may compute (None: as many
        as are resident). It never sizes the pool; the scheduler's policy applies it."""
        return None

    def slots_total(self) -> int:
        return 0

    def slots_used(self) -> int:
        return 0

    def slots_draining(self) -> int:
        return 0

    def suspensions(self) -> int:
        """Running requests that gave their slot up for a waiting adapter so far (cumulative)."""
        return 0

    def requests_suspended(self) -> int:
        """Requests suspended now (KV kept, no slot)."""
        return 0

    def slot_queue(self) -> dict[str, float]:
        """Adapters waiting for a slot -> seconds waited so far."""
        return {}


class NoAdapters(AdapterSlots):
    """Base model only: every adapter name is unknown."""

    def acquire(self, adapter_name: str) -> int | None:
        raise AdapterNotFound(
            f"adapter {adapter_name!r} is not available: this server runs without LoRA support",
            adapter=adapter_name,
        )

    def release(self, adapter_name: str) -> None:
        raise AdapterNotFound(f"adapter {adapter_name!r} was never acquired", adapter=adapter_name)
