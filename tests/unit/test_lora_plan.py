"""`loraplex.kernels.lora_plan`: one launch plan per step, from the config tables' buckets only."""

from __future__ import annotations

from loraplex.kernels.lora_configs import (
    DECODE_MAX_TOKENS,
    MANY_ADAPTERS,
    expand_config,
    shrink_config,
    shrink_splits,
)
from loraplex.kernels.lora_plan import GroupShape, lora_tier, plan_step, tier_distinct_bound

# Llama-3.1-8B's groups at rank 16: every table entry has a row for them.
SHAPES = {
    "qkv": GroupShape(in_features=4096, widths=(4096, 1024, 1024), max_rank=16),
    "o": GroupShape(in_features=4096, widths=(4096,), max_rank=16),
    "gate_up": GroupShape(in_features=4096, widths=(14336, 14336), max_rank=16),
    "down": GroupShape(in_features=14336, widths=(4096,), max_rank=16),
}


def test_plan_takes_the_tables_entries_per_group():
    for num_tokens, distinct in [(1, 1), (64, 8), (64, 64), (700, 4)]:
        plan = plan_step(SHAPES, num_tokens, num_slots=64, max_distinct=distinct)
        many = distinct > MANY_ADAPTERS
        assert plan.num_tokens == num_tokens and plan.many_adapters == many
        assert plan.distinct_bound == distinct and set(plan.groups) == set(SHAPES)
        for group, shape in SHAPES.items():
            launch, n = plan.groups[group], len(shape.widths)
            assert launch.splits == shrink_splits(shape.in_features, num_tokens, many)
            assert launch.shrink == shrink_config(shape.in_features, n, 16, num_tokens)
            assert launch.expand == expand_config(sum(shape.widths), n, 16, num_tokens, many)
            assert launch.distinct_bound == distinct


def test_upper_tier_takes_the_per_token_expand_only_for_decode():
    many = plan_step(SHAPES, 64, num_slots=64, max_distinct=MANY_ADAPTERS + 1)
    few = plan_step(SHAPES, 64, num_slots=64, max_distinct=MANY_ADAPTERS)
    assert all(launch.expand.per_token for launch in many.groups.values())
    assert not any(launch.expand.per_token for launch in few.groups.values())
    prefill = plan_step(SHAPES, DECODE_MAX_TOKENS + 1, num_slots=64, max_distinct=64)
    assert not any(launch.expand.per_token for launch in prefill.groups.values())


def test_unknown_bound_plans_for_the_whole_pool():
    plan = plan_step(SHAPES, 32, num_slots=40)
    assert plan.distinct_bound == 40 and not plan.many_adapters
    assert plan_step(SHAPES, 32, num_slots=10, max_distinct=32).distinct_bound == 10


def test_tiers_and_their_bounds_agree():
    assert [lora_tier(d) for d in (0, 1, MANY_ADAPTERS, MANY_ADAPTERS + 1, 64)] == [0, 1, 1, 2, 2]
    for num_tokens in (MANY_ADAPTERS + 1, 64, 256):
        for tier in (1, 2):
            bound = tier_distinct_bound(tier, num_tokens)
            assert lora_tier(bound) == tier, "a graph's plan must be its own tier's"


def test_kernel_choices_change_only_at_bucket_edges():
    """What reaches a kernel as a compile-time constant (splits, block sizes) is a function of the
    token-count bucket, never of the exact token count: a plan adds no Triton specialisation."""
    edges = (1, 16, 17, DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1, 4096)
    buckets = [(1, 16), (17, DECODE_MAX_TOKENS), (DECODE_MAX_TOKENS + 1, 4096)]
    assert all(any(lo <= t <= hi for lo, hi in buckets) for t in edges)
    for distinct in (1, MANY_ADAPTERS + 1):
        for lo, hi in buckets:
            choices = {
                tuple((g, launch.splits, launch.shrink, launch.expand) for g, launch in plan.groups.items())
                for plan in (plan_step(SHAPES, t, 64, distinct) for t in range(lo, hi + 1, 7))
            }
            assert len(choices) == 1, (lo, hi, distinct)
