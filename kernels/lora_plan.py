"""The LoRA launch plan of one step: every choice the step's shrink and expand launches depend on,
made once per step (in the backend's `prepare`) and passed to each launch explicitly.

Per module group the plan holds the shrink's K-split count and the shrink and expand block sizes
(from the tables in `loraplex.kernels.lora_configs`). What picks them: the step's token count (decode or
prefill family, splits bucket), the pool's shapes, and a bound on the distinct adapters among the
step's tokens, which decides whether the `decode_many` entries apply (more than MANY_ADAPTERS) and
how many token blocks a grid covers.

No value here comes from a per-step size except through the tables' buckets and the grid, so a
plan adds no Triton specialisation that warm-up has not compiled (docs/architecture.md, "Nothing
compiles while serving"). A decode CUDA graph is captured with the plan of its LoRA tier
(`tier_distinct_bound`) and serves every step of that tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from loraplex.kernels.lora_configs import (
    MANY_ADAPTERS,
    ExpandConfig,
    ShrinkConfig,
    expand_config,
    shrink_config,
    shrink_splits,
)


class GroupShape(NamedTuple):
    """What the plan needs of a module group's pool buffers (fixed for the pool's lifetime)."""

    in_features: int  # d: the shrink's K
    widths: tuple[int, ...]  # output width of each stacked module, in stack order
    max_rank: int  # R: the pool's rank columns per stacked module


class GroupLaunch(NamedTuple):
    """One group's shrink and expand launches for a step."""

    splits: int  # K-splits of shrink: partial sums `y[splits, T, n*R]` that expand adds up
    shrink: ShrinkConfig
    expand: ExpandConfig
    # At most this many distinct slots among the step's tokens: the grids cover the token blocks
    # such a step can have (`num_blocks_bound`), not one partial block per pool slot.
    distinct_bound: int


class LoRAPlan(NamedTuple):
    """The launch plan of one step (see the module docstring)."""

    num_tokens: int
    distinct_bound: int  # at most this many distinct adapter slots among the tokens (grid size)
    many_adapters: bool  # more than MANY_ADAPTERS distinct adapters: the `decode_many` entries
    groups: Mapping[str, GroupLaunch]  # per module group of the pool


def many_adapters(max_distinct: int | None) -> bool:
    """Whether a step bounded by `max_distinct` distinct adapters takes the `decode_many` entries
    (None: unknown, so not)."""
    return max_distinct is not None and max_distinct > MANY_ADAPTERS


def lora_tier(distinct: int) -> int:
    """The LoRA tier of a step with `distinct` distinct adapters, which picks the captured graph:
    0 none (no LoRA work), 1 up to MANY_ADAPTERS, 2 more (the `decode_many` entries)."""
    return 0 if not distinct else 1 if distinct <= MANY_ADAPTERS else 2


def graph_tiers(max_distinct: int | None) -> tuple[int, ...]:
    """The LoRA tiers CUDA graphs capture when a step holds at most `max_distinct` distinct adapters
    (None: no LoRA backend): tier 2 only where a step can exceed MANY_ADAPTERS."""
    if max_distinct is None:
        return (0,)
    return (0, 1, 2) if max_distinct > MANY_ADAPTERS else (0, 1)


def tier_distinct_bound(tier: int, num_tokens: int) -> int:
    """The distinct-adapter bound a graph of `tier` (1 or 2) over `num_tokens` tokens is planned with:
    the most any step of that tier can have, since one graph serves them all."""
    return MANY_ADAPTERS if tier == 1 else num_tokens


def plan_group(
    shape: GroupShape,
    num_tokens: int,
    distinct_bound: int,
    many: bool = False,
) -> GroupLaunch:
    """A group's launches for `num_tokens` tokens over at most `distinct_bound` distinct slots
    (`many`: take the `decode_many` entries)."""
    n_stack, width = len(shape.widths), sum(shape.widths)
    return GroupLaunch(
        splits=shrink_splits(shape.in_features, num_tokens, many),
        shrink=shrink_config(shape.in_features, n_stack, shape.max_rank, num_tokens),
        expand=expand_config(width, n_stack, shape.max_rank, num_tokens, many),
        distinct_bound=distinct_bound,
    )


def plan_step(
    shapes: Mapping[str, GroupShape],
    num_tokens: int,
    num_slots: int,
    max_distinct: int | None = None,
) -> LoRAPlan:
    """The plan of a step of `num_tokens` tokens over a pool of `num_slots` slots, with at most
    `max_distinct` distinct adapters among the tokens (None: any of the pool's)."""
    bound = num_slots if max_distinct is None else min(num_slots, max_distinct)
    many = many_adapters(max_distinct)
    return LoRAPlan(
        num_tokens=num_tokens,
        distinct_bound=bound,
        many_adapters=many,
        groups={g: plan_group(shape, num_tokens, bound, many) for g, shape in shapes.items()},
    )
