"""The grouped MoE GEMM's sort and tile table in one Triton launch (kernels/moe_grouped.py).

`moe_tiles` in torch takes ~25 small launches (argsort, bincount by scatter, two cumsums, a
searchsorted and the gathers); inside a decode graph each costs a few microseconds, times every
MoE layer. Here one program per expert builds the whole per-expert histogram from the routed
experts (a one-hot sum over chunks of pairs: cheap at decode sizes, ~E x pairs compares per
program in prefill), then
- program 0 writes the tile table: tile t belongs to the expert whose tile range holds t (experts
  counted by how many tile ranges end at or before t), rows `start_e + (t - first_tile_e) * BLOCK_M`;
- program e writes its pairs' indices, in pair order (stable, as `argsort(stable=True)`), at
  `start_e + rank`, the rank a cumulative sum of the matches.
Outputs equal `moe_grouped.moe_tiles` exactly (tests/integration/test_moe_grouped.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The pair and tile counts change with every step's size: not specialised on (one compile per model).
@triton.jit(do_not_specialize=["pairs", "max_tiles"])
def _moe_align_kernel(
    experts_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_end_ptr,
    pairs,
    num_experts,
    max_tiles,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    e = tl.program_id(0)
    bins = tl.arange(0, E_P2)
    hist = tl.zeros((E_P2,), dtype=tl.int32)
    for p0 in range(0, pairs, BLOCK_P):
        idx = p0 + tl.arange(0, BLOCK_P)
        vals = tl.load(experts_ptr + idx, mask=idx < pairs, other=E_P2).to(tl.int32)  # E_P2: no bin
        hist += tl.sum((vals[:, None] == bins[None, :]).to(tl.int32), axis=0)
    ends = tl.cumsum(hist, axis=0)
    starts = ends - hist
    tiles = (hist + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    tile_starts = tile_ends - tiles
    if e == 0:  # the tile table (padding bins have no tiles: their tile_ends are the total)
        for t0 in range(0, max_tiles, BLOCK_P):
            t = t0 + tl.arange(0, BLOCK_P)
            owner = tl.sum((tile_ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
            owner = tl.minimum(owner, num_experts)  # past the last used tile: num_experts
            sel = bins[None, :] == owner[:, None]
            first = tl.sum(tl.where(sel, tile_starts[None, :], 0), axis=1)
            start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
            count = tl.sum(tl.where(sel, hist[None, :], 0), axis=1)
            tmask = t < max_tiles
            tl.store(tile_expert_ptr + t, owner, mask=tmask)
            tl.store(tile_row_ptr + t, start + (t - first) * BLOCK_M, mask=tmask)
            tl.store(tile_end_ptr + t, start + count, mask=tmask)
    start_e = tl.sum(tl.where(bins == e, starts, 0), axis=0)
    running = start_e
    for p0 in range(0, pairs, BLOCK_P):
        idx = p0 + tl.arange(0, BLOCK_P)
        vals = tl.load(experts_ptr + idx, mask=idx < pairs, other=E_P2).to(tl.int32)
        match = (vals == e).to(tl.int32)
        rank = tl.cumsum(match, axis=0) - 1
        tl.store(order_ptr + running + rank, idx, mask=match != 0)
        running += tl.sum(match, axis=0)


def moe_tiles_triton(experts: torch.Tensor, num_experts: int, block_m: int, max_tiles: int) -> tuple:
    """(order, tile expert ids, tile first rows, tile row ends), int32, as `moe_grouped.moe_tiles`."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    e_p2 = max(2, triton.next_power_of_2(num_experts))
    block_p = max(16, 4096 // e_p2)  # the one-hot chunk [BLOCK_P, E_P2] stays ~4K elements
    order = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    # three allocations, not rows of one: each pointer 16-byte aligned whatever max_tiles is (one
    # specialisation key for every step size, kernels/compile_watch.py)
    tile_expert, tile_row, tile_end = (
        torch.empty(max_tiles, dtype=torch.int32, device=flat.device) for _ in range(3)
    )
    _moe_align_kernel[(num_experts,)](
        flat, order, tile_expert, tile_row, tile_end, pairs, num_experts, max_tiles,
        E_P2=e_p2, BLOCK_M=block_m, BLOCK_P=block_p,
    )  # fmt: skip
    return order, tile_expert, tile_row, tile_end
