"""Fused LoRA kernel vs its torch reference (and vs the two-kernel path) on random inputs.

Shared by the CPU test (a child process under TRITON_INTERPRET=1: Triton picks interpreter vs
compiler when a kernel is decorated) and the GPU benchmark (bf16, before any timing).
`python -m loraplex.kernels.lora_fused_check` prints one JSON line per case.
"""

from __future__ import annotations

import json
import random
import sys
from typing import NamedTuple

import torch

from loraplex.kernels.lora_check import Case, _rel, _segments, _token_slots
from loraplex.kernels.lora_configs import FusedConfig
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_fused import lora_fused, lora_fused_ref
from loraplex.kernels.lora_meta import BLOCK_MS, LoRASegments
from loraplex.kernels.lora_plan import GroupShape, plan_group
from loraplex.kernels.lora_shrink import lora_shrink


class FusedCase(NamedTuple):
    case: Case  # shapes, ranks per slot, dtype, slot pattern (lora_check's)
    config: FusedConfig


class FusedResult(NamedTuple):
    name: str
    num_slots: int
    rel_err: float  # accumulate mode: the added delta vs the reference's
    untouched_rows_equal: bool  # tokens without adapter keep their output bit for bit
    delta_rel_err: float  # accumulate=False into a poisoned float32 buffer vs the reference
    delta_untouched: bool  # tokens without adapter: delta rows never written (still NaN)
    delta_adds_up: bool  # dtype(float(base) + delta) == accumulate's output, bit for bit
    vs_two_kernel_rel_err: float  # against lora_shrink + lora_expand (one K-split)
    delta_norm: float  # the reference delta's norm (0 only when no token has work)


class GroupInputs(NamedTuple):
    x: torch.Tensor  # [T, d]
    A: torch.Tensor  # [slots, n*R, d]
    B: torch.Tensor  # [slots, sum(widths), R]
    ranks: torch.Tensor  # int32 [slots, n]
    scalings: torch.Tensor  # float32 [slots, n]
    slots: torch.Tensor  # each token's slot (-1: none)
    segs: LoRASegments
    out0: torch.Tensor  # the base output [T, sum(widths)]


def poisoned_inputs(case: Case, device: str, gen: torch.Generator) -> GroupInputs:
    """A case's random inputs, the pool's padding past each slot's rank NaN (it is stale memory
    there: reading it shows)."""
    dtype = getattr(torch, case.dtype)
    n, num_slots, R, T = len(case.widths), len(case.ranks), case.max_rank, case.num_tokens

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rand(T, case.d)
    A = rand(num_slots, n * R, case.d, scale=case.d**-0.5)
    B = rand(num_slots, sum(case.widths), R, scale=R**-0.5)
    for s, slot_ranks in enumerate(case.ranks):
        off = 0
        for i, w in enumerate(case.widths):
            A[s, i * R + slot_ranks[i] : (i + 1) * R] = float("nan")
            B[s, off : off + w, slot_ranks[i] :] = float("nan")
            off += w
    ranks = torch.tensor(case.ranks, dtype=torch.int32, device=device)
    scalings = (torch.rand(num_slots, n, generator=gen) + 0.5).to(device)
    slots = _token_slots(case, num_slots, gen).to(device)
    segs = _segments(slots, T + 3, num_slots, device)
    return GroupInputs(x, A, B, ranks, scalings, slots, segs, rand(T, sum(case.widths)))


def run_fused_case(fc: FusedCase, device: str = "cpu", seed: int = 0) -> FusedResult:
    case, cfg = fc.case, fc.config
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    n, num_slots, R, T = len(case.widths), len(case.ranks), case.max_rank, case.num_tokens

    x, A, B, ranks, scalings, slots, segs, out0 = poisoned_inputs(case, device, gen)
    launch = plan_group(GroupShape(case.d, case.widths, R), T, distinct_bound=num_slots)
    launch = launch._replace(fused=cfg, splits=1)

    out, out_ref = out0.clone(), out0.clone()
    lora_fused(x, A, B, ranks, scalings, segs, out, case.widths, launch)
    lora_fused_ref(x, A, B, ranks, scalings, segs, out_ref, case.widths)
    no_adapter = slots < 0
    has = ~no_adapter
    untouched = bool(torch.equal(out[no_adapter], out0[no_adapter]))
    err = _rel(out.float() - out0.float(), out_ref.float() - out0.float())

    delta = torch.full((T, sum(case.widths)), float("nan"), device=device)
    delta_ref = delta.clone()
    lora_fused(x, A, B, ranks, scalings, segs, delta, case.widths, launch, accumulate=False)
    lora_fused_ref(x, A, B, ranks, scalings, segs, delta_ref, case.widths, accumulate=False)
    delta_err = _rel(delta[has], delta_ref[has]) if bool(has.any()) else 0.0
    adds_up = bool(torch.equal((out0[has].float() + delta[has]).to(dtype), out[has]))

    y = torch.zeros(1, T, n * R, dtype=torch.float32, device=device)
    two = out0.clone()
    lora_shrink(x, A, ranks, segs, y, launch)
    lora_expand(y, B, ranks, scalings, segs, two, case.widths, launch)
    return FusedResult(
        name=case.name,
        num_slots=num_slots,
        rel_err=err,
        untouched_rows_equal=untouched,
        delta_rel_err=delta_err,
        delta_untouched=bool(delta[no_adapter].isnan().all()),
        delta_adds_up=adds_up,
        vs_two_kernel_rel_err=_rel(out.float() - out0.float(), two.float() - out0.float()),
        delta_norm=(out_ref.float() - out0.float()).norm().item(),
    )


def random_case(rnd: random.Random, i: int, num_slots: int, num_tokens: int, dtype: str) -> FusedCase:
    """A random group shape (1-3 stacks of uneven widths), mixed ranks with zeros, random blocks."""
    n = rnd.randint(1, 3)
    widths = tuple(rnd.choice((8, 16, 24, 40, 64)) for _ in range(n))
    max_rank = rnd.choice((4, 8, 12, 16, 32))
    ranks = tuple(
        tuple(0 if rnd.random() < 0.2 else rnd.randint(1, max_rank) for _ in range(n))
        for _ in range(num_slots)
    )
    pattern = rnd.choice(("random", "random", "one_big", "distinct" if num_tokens <= num_slots else "random"))
    block_n = rnd.choice((16, 32))
    cfg = FusedConfig(
        block_m=rnd.choice(BLOCK_MS[:2]),
        block_k=rnd.choice((16, 32)),
        block_n=block_n,
        chunk_n=block_n * rnd.randint(1, 3),
        num_warps=4,
        num_stages=2,
    )
    d = rnd.choice((16, 32, 48))
    case = Case(f"random{i}_{dtype}", num_tokens, d, widths, max_rank, ranks, dtype, slot_pattern=pattern)
    return FusedCase(case, cfg)


def fused_cases(seed: int = 0) -> list[FusedCase]:
    """Fixed corner cases, then random ones from 1 to 256 adapters."""
    rnd = random.Random(seed)
    r4 = ((1, 4, 0), (16, 8, 16), (0, 0, 0), (8, 16, 4))
    cfg = FusedConfig(block_m=16, block_k=32, block_n=16, chunk_n=32, num_warps=4, num_stages=2)
    cases = [
        FusedCase(Case("qkv_gqa_fp32", 37, 200, (48, 16, 16), 16, r4, "float32"), cfg),
        FusedCase(Case("qkv_gqa_fp16", 37, 64, (48, 16, 16), 16, r4, "float16"), cfg),
        FusedCase(
            Case("no_adapter_tokens", 12, 40, (16, 8), 8, ((8, 8),), "float32", slot_pattern="none"), cfg
        ),
        FusedCase(
            Case("single_token", 1, 24, (24,), 8, ((8,), (4,)), "float32", slot_pattern="one_big"), cfg
        ),
        FusedCase(
            Case("rank64_pool_mixed", 20, 32, (32, 32), 64, ((64, 64), (4, 0), (0, 16), (1, 64)), "float16"),
            cfg._replace(block_m=32),
        ),
        # Many adapters of tiny dims: 256 slots, one token each, ranks 0..4.
        FusedCase(
            Case(
                "256_adapters_tiny",
                256,
                16,
                (8,),
                4,
                tuple(((s % 5),) for s in range(256)),
                "float32",
                slot_pattern="distinct",
            ),
            FusedConfig(block_m=16, block_k=16, block_n=16, chunk_n=16, num_warps=4, num_stages=2),
        ),
    ]
    for i, (slots, tokens) in enumerate(((1, 9), (3, 40), (8, 64), (24, 32), (64, 32), (160, 40))):
        cases.append(random_case(rnd, i, slots, tokens, "float32" if i % 2 == 0 else "float16"))
    return cases


def passed(r: FusedResult, dtype: str) -> bool:
    tol = 1e-5 if dtype == "float32" else 2e-2
    return (
        r.rel_err < tol
        and r.delta_rel_err < tol
        and r.vs_two_kernel_rel_err < max(tol, 1e-4)
        and r.untouched_rows_equal
        and r.delta_untouched
        and r.delta_adds_up
    )


def main() -> int:
    bad = 0
    for fc in fused_cases():
        r = run_fused_case(fc)
        ok = passed(r, fc.case.dtype)
        bad += not ok
        print(json.dumps(dict(r._asdict(), ok=ok)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
