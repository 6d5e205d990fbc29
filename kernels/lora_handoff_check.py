"""The one-launch LoRA handoff (`kernels/lora_handoff.py`) against the two-kernel path and the torch
references on random inputs: mixed ranks with zeros, 1 to 256 adapters, K-splits, block and per-token
expands, in-place and delta modes, and the counters left zero for the next launch.

Shared by the CPU test (a child process under TRITON_INTERPRET=1) and the GPU benchmark.
`python -m loraplex.kernels.lora_handoff_check` prints one JSON line per case.
"""

from __future__ import annotations

import json
import random
import sys
from typing import NamedTuple

import torch

from loraplex.kernels.lora_check import Case, _rel
from loraplex.kernels.lora_configs import ExpandConfig, ShrinkConfig
from loraplex.kernels.lora_expand import lora_expand, lora_expand_ref
from loraplex.kernels.lora_fused_check import poisoned_inputs
from loraplex.kernels.lora_handoff import alloc_handoff_counters, lora_handoff
from loraplex.kernels.lora_plan import GroupShape, plan_group
from loraplex.kernels.lora_shrink import lora_shrink, lora_shrink_ref


class HandoffCase(NamedTuple):
    case: Case  # shapes, ranks per slot, dtype, slot pattern (lora_check's)
    splits: int
    shrink: ShrinkConfig
    expand: ExpandConfig


class HandoffResult(NamedTuple):
    name: str
    num_slots: int
    splits: int
    per_token: bool
    vs_two_kernel_rel_err: float  # in place: against lora_shrink + lora_expand with the same launch
    vs_reference_rel_err: float  # in place: against the torch references
    untouched_rows_equal: bool  # tokens without adapter keep their output bit for bit
    delta_vs_two_kernel_rel_err: float  # accumulate=False into a NaN-poisoned float32 buffer
    delta_untouched: bool  # tokens without adapter: delta rows never written (still NaN)
    counters_zero: bool  # both launches left every counter at 0
    delta_norm: float  # the reference delta's norm (0 only when no token has work)


def run_handoff_case(hc: HandoffCase, device: str = "cpu", seed: int = 0) -> HandoffResult:
    case = hc.case
    gen = torch.Generator().manual_seed(seed)
    n, num_slots, R, T = len(case.widths), len(case.ranks), case.max_rank, case.num_tokens

    x, A, B, ranks, scalings, slots, segs, out0 = poisoned_inputs(case, device, gen)
    launch = plan_group(GroupShape(case.d, case.widths, R), T, distinct_bound=num_slots)
    launch = launch._replace(splits=hc.splits, shrink=hc.shrink, expand=hc.expand)
    counters = alloc_handoff_counters(T + 3, device)

    def y_buf() -> torch.Tensor:
        return torch.zeros(hc.splits, T, n * R, dtype=torch.float32, device=device)

    got, two, ref = out0.clone(), out0.clone(), out0.clone()
    lora_handoff(x, A, B, ranks, scalings, segs, y_buf(), got, case.widths, launch, counters)
    zero = bool((counters == 0).all())
    y_two = y_buf()
    lora_shrink(x, A, ranks, segs, y_two, launch)
    lora_expand(y_two, B, ranks, scalings, segs, two, case.widths, launch)
    y_ref = torch.zeros(T, n * R, dtype=torch.float32, device=device)
    lora_shrink_ref(x, A, ranks, segs, y_ref)
    lora_expand_ref(y_ref, B, ranks, scalings, segs, ref, case.widths)
    no_adapter, has = slots < 0, slots >= 0

    delta = torch.full((T, sum(case.widths)), float("nan"), device=device)
    delta_two = delta.clone()
    lora_handoff(
        x, A, B, ranks, scalings, segs, y_buf(), delta, case.widths, launch, counters, accumulate=False
    )
    zero &= bool((counters == 0).all())
    lora_expand(y_two, B, ranks, scalings, segs, delta_two, case.widths, launch, accumulate=False)
    return HandoffResult(
        name=case.name,
        num_slots=num_slots,
        splits=hc.splits,
        per_token=bool(hc.expand.per_token),
        vs_two_kernel_rel_err=_rel(got.float() - out0.float(), two.float() - out0.float()),
        vs_reference_rel_err=_rel(got.float() - out0.float(), ref.float() - out0.float()),
        untouched_rows_equal=bool(torch.equal(got[no_adapter], out0[no_adapter])),
        delta_vs_two_kernel_rel_err=_rel(delta[has], delta_two[has]) if bool(has.any()) else 0.0,
        delta_untouched=bool(delta[no_adapter].isnan().all()),
        counters_zero=zero,
        delta_norm=(ref.float() - out0.float()).norm().item(),
    )


def _configs(rnd: random.Random, per_token: bool) -> tuple[ShrinkConfig, ExpandConfig]:
    block_m = rnd.choice((16, 32))
    shrink = ShrinkConfig(block_m=block_m, block_r=rnd.choice((8, 16)), block_k=16, num_warps=2, num_stages=2)
    block_n = rnd.choice((16, 32))
    expand = ExpandConfig(
        block_m=block_m,
        block_n=block_n,
        chunk_n=block_n * rnd.randint(1, 3),
        num_warps=4,
        num_stages=2,
        per_token=int(per_token),
    )
    return shrink, expand


def handoff_cases(seed: int = 0) -> list[HandoffCase]:
    """Fixed corner cases, then random ones from 1 to 256 adapters, block and per-token expands."""
    rnd = random.Random(seed)
    r4 = ((1, 4, 0), (16, 8, 16), (0, 0, 0), (8, 16, 4))
    shrink = ShrinkConfig(block_m=16, block_r=8, block_k=16, num_warps=2, num_stages=2)
    expand = ExpandConfig(block_m=16, block_n=16, chunk_n=32, num_warps=4, num_stages=2)
    per_token = expand._replace(per_token=1)
    tiny = tuple(((s % 5),) for s in range(256))
    cases = [
        HandoffCase(Case("qkv_gqa_fp32", 37, 64, (48, 16, 16), 16, r4, "float32"), 3, shrink, expand),
        HandoffCase(
            Case("qkv_gqa_fp16_per_token", 37, 64, (48, 16, 16), 16, r4, "float16"), 2, shrink, per_token
        ),
        HandoffCase(
            Case("no_adapter_tokens", 12, 40, (16, 8), 8, ((8, 8),), "float32", slot_pattern="none"),
            2,
            shrink,
            expand,
        ),
        # K-splits past the input width: empty splits still count.
        HandoffCase(
            Case("empty_splits", 9, 32, (24,), 8, ((8,), (4,)), "float32", slot_pattern="one_big"),
            5,
            shrink,
            expand,
        ),
        HandoffCase(
            Case("rank64_pool_mixed", 20, 32, (32, 32), 64, ((64, 64), (4, 0), (0, 16), (1, 64)), "float16"),
            2,
            shrink._replace(block_m=32, block_r=32),
            expand._replace(block_m=32),
        ),
        HandoffCase(
            Case("256_adapters_tiny", 256, 16, (8,), 4, tiny, "float32", slot_pattern="distinct"),
            2,
            shrink._replace(block_r=4 * 2),
            per_token._replace(block_n=16, chunk_n=16),
        ),
    ]
    for i, (slots, tokens) in enumerate(((1, 9), (3, 40), (8, 64), (24, 32), (64, 32), (160, 40))):
        n = rnd.randint(1, 3)
        widths = tuple(rnd.choice((8, 16, 24, 40, 64)) for _ in range(n))
        max_rank = rnd.choice((4, 8, 12, 16, 32))
        ranks = tuple(
            tuple(0 if rnd.random() < 0.2 else rnd.randint(1, max_rank) for _ in range(n))
            for _ in range(slots)
        )
        pattern = rnd.choice(("random", "one_big", "distinct" if tokens <= slots else "random"))
        dtype = "float32" if i % 2 == 0 else "float16"
        case = Case(
            f"random{i}_{dtype}",
            tokens,
            rnd.choice((16, 32, 48)),
            widths,
            max_rank,
            ranks,
            dtype,
            slot_pattern=pattern,
        )
        s, e = _configs(rnd, per_token=i % 3 == 2)
        cases.append(HandoffCase(case, rnd.randint(1, 4), s, e))
    return cases


def passed(r: HandoffResult, dtype: str, exact: bool) -> bool:
    """`exact`: the interpreter, where the handoff's arithmetic is the two-kernel path's to the bit."""
    tol = 1e-5 if dtype == "float32" else 2e-2
    return (
        (r.vs_two_kernel_rel_err == 0.0 if exact else r.vs_two_kernel_rel_err < tol)
        and r.vs_reference_rel_err < tol
        and (r.delta_vs_two_kernel_rel_err == 0.0 if exact else r.delta_vs_two_kernel_rel_err < tol)
        and r.untouched_rows_equal
        and r.delta_untouched
        and r.counters_zero
    )


def main() -> int:
    bad = 0
    for hc in handoff_cases():
        r = run_handoff_case(hc)
        ok = passed(r, hc.case.dtype, exact=True)
        bad += not ok
        print(json.dumps(dict(r._asdict(), ok=ok)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
