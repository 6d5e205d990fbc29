"""The host tier below the GPU pool: which host copies of adapter weights LoRAManager drops, as a pure
function (like lora/slot_choice.py), so the manager keeps every write under its lock.

Host copies are pinned on CUDA (an upload from them is an asynchronous copy on the pool's side
stream); a dropped copy is re-read, digest-checked, from its source (the disk cache) when its
adapter is next placed in a slot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class HostCopy(Protocol):
    """What the choice reads of an adapter version that has a host copy."""

    refs: int  # requests computing on its slot
    held: int  # suspended requests keeping it
    pinned: bool
    last_used: float
    nbytes: int  # of the host copy


C = TypeVar("C", bound=HostCopy)


def copies_to_drop(
    copies: Sequence[C], max_count: int | None, max_bytes: int | None, keep: C | None = None
) -> list[C]:
    """The least recently used copies to drop so that at most `max_count` copies and `max_bytes`
    bytes remain (None: that bound is off). Copies a request, a suspended request or a pin needs,
    and `keep`, are never dropped, so they alone may exceed either bound."""
    count_excess = len(copies) - max_count if max_count is not None else 0
    byte_excess = sum(c.nbytes for c in copies) - max_bytes if max_bytes is not None else 0
    out: list[C] = []
    for c in sorted(copies, key=lambda c: c.last_used):
        if count_excess <= 0 and byte_excess <= 0:
            break
        if c.refs == 0 and c.held == 0 and not c.pinned and c is not keep:
            out.append(c)
            count_excess -= 1
            byte_excess -= c.nbytes
    return out
