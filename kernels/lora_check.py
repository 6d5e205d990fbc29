"""Kernel-vs-reference checks for the LoRA shrink/expand kernels on random inputs.

Shared by the CPU tests (run in a child process under TRITON_INTERPRET=1, because Triton
decides interpreter vs compiler when a kernel is decorated) and the GPU benchmark (bf16,
before any timing). `python -m loraplex.kernels.lora_check` prints one JSON line per case.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

import torch

from loraplex.kernels.lora_expand import lora_expand, lora_expand_ref
from loraplex.kernels.lora_meta import (
    BLOCK_MS,
    LoRASegments,
    alloc_segments,
    build_segments,
    build_segments_ref,
    build_segments_triton,
    num_blocks_bound,
    triton_build_fits,
)
from loraplex.kernels.lora_pages import page_a, page_b
from loraplex.kernels.lora_plan import GroupShape, plan_group
from loraplex.kernels.lora_shrink import alloc_shrink_out, lora_shrink, lora_shrink_ref, shrink_out_view


class Case(NamedTuple):
    name: str
    num_tokens: int
    d: int
    widths: tuple[int, ...]
    max_rank: int
    ranks: tuple[tuple[int, ...], ...]  # per slot, per stacked module
    dtype: str
    splits: int | None = None  # None: the table's choice (the step plan's)
    slot_pattern: str = "random"  # random | one_big | none | distinct (one token per slot)
    per_token: bool = False  # expand with one program per token (ExpandConfig.per_token)
    page_rows: int = 8  # rank rows per page of the pool (services/inference/lora/pool.py PAGE_ROWS)
    page_gap: int = 0  # NaN rows between pages (pages as views of bigger blocks: lora/unified.py)


class CaseResult(NamedTuple):
    name: str
    shrink_rel_err: float
    expand_rel_err: float
    y_written_exactly: bool  # kernel wrote every valid y entry and nothing else
    untouched_rows_equal: bool  # tokens without adapter keep their output bit for bit
    splits: int
    delta_norm: float  # norm of the reference's added delta (0 only when no token has work)
    delta_mode_rel_err: float  # expand(accumulate=False) into float32 vs its reference
    delta_mode_adds_up: bool  # dtype(float(base) + delta) == the accumulating kernel's output, bit for bit
    #   (on the CPU interpreter; a GPU may contract the in-place add into an FMA)
    delta_mode_untouched: bool  # tokens without adapter: delta rows never written
    tight_grid_equal: bool  # distinct_bound = the step's distinct slots gives the same bits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _token_slots(case: Case, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    if case.slot_pattern == "none":
        return torch.full((case.num_tokens,), -1, dtype=torch.int32)
    if case.slot_pattern == "distinct":  # every token its own adapter: as many blocks as tokens
        return torch.randperm(num_slots, generator=gen)[: case.num_tokens].to(torch.int32)
    slots = torch.randint(-1, num_slots, (case.num_tokens,), generator=gen, dtype=torch.int32)
    if case.slot_pattern == "one_big":  # a long prefill segment beside single decode tokens
        slots[: max(1, case.num_tokens * 3 // 4)] = 0
        slots = slots[torch.randperm(case.num_tokens, generator=gen)]
    return slots


def _segments(slots: torch.Tensor, max_tokens: int, num_slots: int, device: str) -> LoRASegments:
    """The maps the engine builds, by Triton wherever it would be on a GPU, over buffers poisoned
    with 0 (a real slot and token): a kernel reading what the Triton build leaves unwritten would
    compute wrong numbers, not merely skip work."""
    segs = alloc_segments(max_tokens, num_slots, device)
    if device == "cpu" and triton_build_fits(slots.shape[0], num_slots):
        segs.block_slot.zero_()
        segs.block_tokens.zero_()
        return build_segments_triton(slots, segs)
    return build_segments(slots, segs)


def segments_match(slots: torch.Tensor, num_slots: int, device: str = "cpu") -> bool:
    """The Triton build equals the torch one everywhere a kernel can read for this step."""
    T = slots.shape[0]
    tri, ref = alloc_segments(T + 5, num_slots, device), alloc_segments(T + 5, num_slots, device)
    for t in tri:
        t.fill_(12345)  # stale garbage from an earlier, bigger step
    build_segments_triton(slots, tri)
    build_segments_ref(slots, ref)
    same = all(torch.equal(a[:T], b[:T]) for a, b in zip(tri[:2], ref[:2], strict=True))
    same &= torch.equal(tri.slot_start, ref.slot_start) and torch.equal(tri.slot_count, ref.slot_count)
    for m in BLOCK_MS:
        n = num_blocks_bound(T, num_slots, m)
        (bs_t, bt_t), (bs_r, bt_r) = tri.blocks_for(m), ref.blocks_for(m)
        same &= torch.equal(bs_t[:n], bs_r[:n]) and torch.equal(bt_t[:n, :m], bt_r[:n, :m])
    return bool(same)


SEGMENT_CASES: dict[str, tuple[list[int], int]] = {
    "no adapters": ([-1, -1, -1], 4),
    "one token": ([0], 1),
    "mixed": ([3, 3, 3, 0, -1, 3, 0, 2], 4),
    "long segment": ([1] * 130 + [0] * 17 + [-1] * 5, 2),
    "64 distinct, decode": (list(range(63, -1, -1)), 64),
    "256 tokens over 64 slots": ([(7 * i) % 65 - 1 for i in range(256)], 64),
}


def paged_pool(
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: tuple[tuple[int, ...], ...],
    page_rows: int,
    gen: torch.Generator,
    gap: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot A `[slots, n*R, d]` / B `[slots, W, R]` spread over pages as the pool keeps them: each
    slot owns the pages of its own largest rank only, in a shuffled order with free pages between
    (NaN: a kernel reading a page its slot does not own, or a row past the rank, shows in the result);
    the page table's entries past a slot's pages are 0, as in the pool."""
    slots, R = A.shape[0], B.shape[2]
    own = [-(-max(r) // page_rows) for r in ranks]
    num_pages = sum(own) + 3
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(slots, -(-R // page_rows), dtype=torch.int32)
    for s in range(slots):
        table[s, : own[s]] = torch.tensor(order[sum(own[:s]) : sum(own[: s + 1])], dtype=torch.int32)
    table = table.to(A.device)
    n_stack = len(ranks[0])
    a, b = page_a(A, table, own, n_stack, num_pages, page_rows), page_b(B, table, own, num_pages, page_rows)
    if gap:  # each page a view at the head of a bigger NaN block: the page stride is not the page size
        a_big = torch.full(
            (num_pages, a.shape[1] + gap, a.shape[2]), float("nan"), dtype=a.dtype, device=a.device
        )
        b_big = torch.full(
            (num_pages, b.shape[1] + gap, b.shape[2]), float("nan"), dtype=b.dtype, device=b.device
        )
        a_big[:, : a.shape[1]], b_big[:, : b.shape[1]] = a, b
        a, b = a_big[:, : a.shape[1]], b_big[:, : b.shape[1]]
    return a, b, table


def run_case(case: Case, device: str = "cpu", seed: int = 0) -> CaseResult:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    n = len(case.widths)
    num_slots, R = len(case.ranks), case.max_rank

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rand(case.num_tokens, case.d)
    A_dense = rand(num_slots, n * R, case.d, scale=case.d**-0.5)
    B_dense = rand(num_slots, sum(case.widths), R, scale=R**-0.5)
    A, B, pages = paged_pool(A_dense, B_dense, case.ranks, case.page_rows, gen, case.page_gap)
    ranks = torch.tensor(case.ranks, dtype=torch.int32, device=device)
    scalings = (torch.rand(num_slots, n, generator=gen) + 0.5).to(device)
    slots = _token_slots(case, num_slots, gen).to(device)
    segs = _segments(slots, case.num_tokens + 3, num_slots, device)

    # The plan the backend makes for a step over any of the pool's slots.
    launch = plan_group(GroupShape(case.d, case.widths, R), case.num_tokens, distinct_bound=num_slots)
    launch = launch._replace(expand=launch.expand._replace(per_token=int(case.per_token)))
    if case.splits is None:
        buf = alloc_shrink_out(case.num_tokens, n, R, case.d, device)
        y = shrink_out_view(buf, launch.splits, case.num_tokens)
    else:
        launch = launch._replace(splits=case.splits)
        y = torch.empty(case.splits, case.num_tokens, n * R, dtype=torch.float32, device=device)
    y.fill_(float("nan"))  # poison: unwritten entries stay NaN
    y_ref = torch.full_like(y, float("nan"))
    lora_shrink(x, A, ranks, pages, segs, y, launch)
    lora_shrink_ref(x, A, ranks, pages, segs, y_ref)
    ys, ys_ref = y.sum(0), y_ref.sum(0)
    written = bool(torch.equal(ys.isnan(), ys_ref.isnan()))
    valid = ~ys_ref.isnan()
    shrink_err = _rel(ys[valid], ys_ref[valid]) if bool(valid.any()) else 0.0

    out0 = rand(case.num_tokens, sum(case.widths))
    out, out_ref = out0.clone(), out0.clone()
    lora_expand(y, B, ranks, scalings, pages, segs, out, case.widths, launch)
    lora_expand_ref(y_ref, B, ranks, scalings, pages, segs, out_ref, case.widths)
    no_adapter = slots < 0
    untouched = bool(torch.equal(out[no_adapter], out0[no_adapter]))
    # Compare the deltas: the base output would otherwise dwarf the error.
    expand_err = _rel(out.float() - out0.float(), out_ref.float() - out0.float())
    delta_norm = (out_ref.float() - out0.float()).norm().item()

    # Delta mode (the LoRA side stream): poisoned float32 buffer, adapter rows written in full.
    delta = torch.full((case.num_tokens, sum(case.widths)), float("nan"), device=device)
    delta_ref = delta.clone()
    lora_expand(y, B, ranks, scalings, pages, segs, delta, case.widths, launch, accumulate=False)
    lora_expand_ref(y_ref, B, ranks, scalings, pages, segs, delta_ref, case.widths, accumulate=False)
    has = ~no_adapter
    delta_err = _rel(delta[has], delta_ref[has]) if bool(has.any()) else 0.0
    adds_up = bool(torch.equal((out0[has].float() + delta[has]).to(dtype), out[has]))
    delta_untouched = bool(delta[no_adapter].isnan().all())

    # A grid sized for the step's real number of distinct slots: same output, bit for bit.
    distinct = len({int(v) for v in slots.tolist() if v >= 0})
    y_t, out_t = torch.full_like(y, float("nan")), out0.clone()
    tight = launch._replace(distinct_bound=distinct)
    lora_shrink(x, A, ranks, pages, segs, y_t, tight)
    lora_expand(y_t, B, ranks, scalings, pages, segs, out_t, case.widths, tight)
    tight_equal = bool(torch.equal(out_t, out))
    return CaseResult(
        case.name,
        shrink_err,
        expand_err,
        written,
        untouched,
        y.shape[0],
        delta_norm,
        delta_err,
        adds_up,
        delta_untouched,
        tight_equal,
    )


R4 = ((1, 4, 0), (16, 8, 16), (0, 0, 0), (8, 16, 4))
CASES: tuple[Case, ...] = (
    Case("qkv_gqa_fp32", 37, 200, (48, 16, 16), 16, R4, "float32", splits=1),
    Case("qkv_gqa_fp32_split3", 37, 200, (48, 16, 16), 16, R4, "float32", splits=3),
    Case("qkv_gqa_fp16", 37, 200, (48, 16, 16), 16, R4, "float16", splits=2),
    Case("gate_up_rank64_fp16", 20, 72, (96, 96), 64, ((64, 64), (4, 0), (0, 16), (1, 64)), "float16"),
    Case("down_decode_split_table_fp32", 6, 4200, (40,), 16, ((16,), (8,), (0,)), "float32"),
    Case("single_token_fp32", 1, 130, (24,), 8, ((8,), (4,)), "float32", slot_pattern="one_big"),
    Case(
        "mixed_prefill_decode_fp16",
        300,
        40,
        (32, 24),
        16,
        ((16, 4), (1, 8), (16, 16)),
        "float16",
        slot_pattern="one_big",
    ),
    Case("thousands_tokens_fp32", 2048, 24, (20,), 8, ((8,), (1,), (4,)), "float32"),
    Case("even_tiles_fp16", 9, 512, (256, 256), 16, ((16, 3), (0, 9), (12, 16)), "float16"),
    Case("rank_not_multiple_of_8_pool_fp32", 7, 48, (24, 40), 12, ((12, 5), (3, 12)), "float32"),
    # Any page size works: pages of 4 rows (a rank block spans pages) and of 16 (pages span rank blocks)
    Case("pages_of_4_fp32", 37, 200, (48, 16, 16), 16, R4, "float32", splits=2, page_rows=4),
    Case(
        "pages_of_16_mixed_ranks_fp32",
        20,
        72,
        (96, 96),
        64,
        ((64, 64), (4, 0), (0, 16), (1, 40)),
        "float32",
        page_rows=16,
    ),
    Case("pages_in_bigger_blocks_fp32", 37, 200, (48, 16, 16), 16, R4, "float32", splits=2, page_gap=5),
    Case(
        "per_token_pages_in_bigger_blocks_fp16",
        20,
        72,
        (96, 96),
        64,
        ((64, 64), (4, 0), (0, 16), (1, 64)),
        "float16",
        per_token=True,
        page_gap=3,
    ),
    Case("per_token_pages_of_4_fp32", 37, 200, (48, 16, 16), 16, R4, "float32", per_token=True, page_rows=4),
    Case("no_adapter_tokens_fp32", 12, 40, (16, 8), 8, ((8, 8),), "float32", slot_pattern="none"),
    Case(
        "token_per_adapter_fp32",
        8,
        64,
        (32,),
        8,
        tuple((8,) for _ in range(10)),
        "float32",
        slot_pattern="distinct",
    ),
    # One program per token: GQA stacks of uneven widths, K-split partials, mixed ranks (a rank-64
    # pool too), a pool rank that is not a power of 2, no adapters, one token per slot, a long segment.
    Case("per_token_qkv_gqa_fp32_split3", 37, 200, (48, 16, 16), 16, R4, "float32", splits=3, per_token=True),
    Case("per_token_qkv_gqa_fp16", 37, 200, (48, 16, 16), 16, R4, "float16", splits=2, per_token=True),
    Case(
        "per_token_gate_up_rank64_fp16",
        20,
        72,
        (96, 96),
        64,
        ((64, 64), (4, 0), (0, 16), (1, 64)),
        "float16",
        per_token=True,
    ),
    Case(
        "per_token_rank_not_multiple_of_8_fp32",
        7,
        48,
        (24, 40),
        12,
        ((12, 5), (3, 12)),
        "float32",
        per_token=True,
    ),
    Case(
        "per_token_distinct_fp32",
        10,
        64,
        (32,),
        8,
        tuple((8,) for _ in range(10)),
        "float32",
        slot_pattern="distinct",
        per_token=True,
    ),
    Case(
        "per_token_one_big_fp16",
        40,
        24,
        (20,),
        8,
        ((8,), (4,)),
        "float16",
        slot_pattern="one_big",
        per_token=True,
    ),
    Case(
        "per_token_no_adapter_fp32",
        12,
        40,
        (16, 8),
        8,
        ((8, 8),),
        "float32",
        slot_pattern="none",
        per_token=True,
    ),
)


def main() -> None:
    for case in CASES:
        print(json.dumps(run_case(case)._asdict()), flush=True)
    gen = torch.Generator().manual_seed(1)
    random_cases = {
        f"random {i}": (torch.randint(-1, s, (t,), generator=gen).tolist(), s)
        for i, (t, s) in enumerate([(5, 3), (64, 8), (100, 9), (200, 1), (256, 64)])
    }
    for name, (slots, num_slots) in {**SEGMENT_CASES, **random_cases}.items():
        ok = segments_match(torch.tensor(slots, dtype=torch.int32), num_slots)
        print(json.dumps(dict(segments=name, match=ok)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
