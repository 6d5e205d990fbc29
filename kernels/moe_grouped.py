"""Grouped GEMM for a mixture-of-experts MLP: each expert's matmuls over exactly its routed tokens.

The (token, slot) pairs of a step are sorted by expert on the device and cut into tiles of
`BLOCK_M` pairs that belong to one expert (`moe_tiles`): an expert with 3 pairs gets one tile, one
with 40 gets three, one with none gets no tile. The number of tiles a step can need is bounded by
its token count alone (`min(pairs, ceil(pairs / BLOCK_M) + experts)`), so the grid, the table and
every buffer have shapes fixed by the token count: nothing is read on the host and the whole layer
captures in a CUDA graph at any step size. Unused tiles (expert id == E) return at once. The
kernels read the table `moe_align.py` builds in one launch; `moe_tiles` is its torch reference.

Two kernels per layer:
- gate_up: the tile's tokens gathered from `x`, times the expert's gate and up rows, SiLU(gate) *
  up (or tanh-GELU for Gemma-style activations) fused, written in sorted order `[pairs, inter]`;
- down: those rows times the expert's down projection, scaled by each pair's routing weight, stored
  at the pair's original (token, slot) index; the `[tokens, top_k, hidden]` result summed over
  slots is the MoE output in token order (a deterministic scatter-add: each pair written once).

With LoRA on the experts (`lora=`, an `ExpertDeltas`), each pair's gate_up delta is added to the
accumulators before the activation and its down delta before the routing weight (HAS_DELTA).

`grouped_moe_ref` is the torch reference (float32 accumulation, the same roundings).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from loraplex.kernels.moe_align import moe_tiles_triton


class ExpertDeltas(Protocol):
    """LoRA on the experts as `grouped_moe` takes it: each (token, slot) pair's delta, rows in pair
    order (`token * top_k + slot`), in `x`'s dtype."""

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """`[T * top_k, 2 * inter]` from the layer input `x` `[T, hidden]`."""
        ...

    def down(self, act: torch.Tensor) -> torch.Tensor:
        """`[T * top_k, hidden]` from each pair's activation `act` `[T * top_k, inter]`."""
        ...


def moe_tiles(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(pair order sorted by expert, tile expert ids, tile first rows, tile row ends), on the device.

    `experts` `[T, k]`. Rows index the sorted pairs; `order[row]` is the pair's flat index
    `token * k + slot`. Tiles past the last used one have expert id `num_experts` (their rows are
    unspecified). The torch reference of `moe_align.moe_tiles_triton`.
    """
    flat = experts.flatten()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    max_tiles = max_tiles_for(pairs, num_experts, block_m)
    ids = torch.arange(max_tiles, device=flat.device)
    tile_expert = torch.searchsorted(tile_ends, ids, right=True)
    e = tile_expert.clamp(max=num_experts - 1)
    first_tile = tile_ends[e] - tiles[e]
    tile_row = ends[e] - counts[e] + (ids - first_tile) * block_m
    return (
        order.to(torch.int32),
        tile_expert.to(torch.int32),
        tile_row.to(torch.int32),
        ends[e].to(torch.int32),
    )


def max_tiles_for(pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles a step of `pairs` (token, slot) pairs can need: each non-empty one holds >= 1 pair."""
    return max(1, min(pairs, -(-pairs // block_m) + num_experts))


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_end_ptr,
    delta_ptr,
    num_experts,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_om,
    stride_dm,
    GELU: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < num_experts:
        row0 = tl.load(tile_row_ptr + tile)
        row_end = tl.load(tile_end_ptr + tile)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        pair = tl.load(order_ptr + rows, mask=rmask, other=0)
        token = (pair // top_k).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < inter
        w_base = w_ptr + e * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < hidden
            a = tl.load(
                x_ptr + token[:, None] * stride_xt + ks[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            )
            wmask = kmask[:, None] & cmask[None, :]
            wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=wmask, other=0.0)
            acc_gate = tl.dot(a, wg, acc_gate)
            acc_up = tl.dot(a, wu, acc_up)
        if HAS_DELTA:  # LoRA on the expert: its delta, per (token, slot) pair, before the activation
            dmask = rmask[:, None] & cmask[None, :]
            d_row = delta_ptr + pair.to(tl.int64)[:, None] * stride_dm
            acc_gate += tl.load(d_row + cols[None, :], mask=dmask, other=0.0).to(tl.float32)
            acc_up += tl.load(d_row + inter + cols[None, :], mask=dmask, other=0.0).to(tl.float32)
        if GELU:  # tanh approximation; tanh(y) = 2 sigmoid(2y) - 1
            inner = 0.7978845608028654 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
            act = 0.5 * acc_gate * (2.0 * tl.sigmoid(2.0 * inner))
        else:
            act = acc_gate * tl.sigmoid(acc_gate)
        act = act * acc_up
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    weight_ptr,
    out_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_end_ptr,
    delta_ptr,
    num_experts,
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_op,
    stride_dm,
    HAS_DELTA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if e < num_experts:
        row0 = tl.load(tile_row_ptr + tile)
        row_end = tl.load(tile_end_ptr + tile)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        pair = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < hidden
        w_base = w_ptr + e * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < inter
            a = tl.load(
                act_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                mask=rmask[:, None] & kmask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + cols[None, :] * stride_wn + ks[:, None],
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
            acc = tl.dot(a, w, acc)
        if HAS_DELTA:  # LoRA on the expert: its delta before the routing weight
            d = delta_ptr + pair[:, None] * stride_dm + cols[None, :]
            acc += tl.load(d, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
        out = out_ptr + pair[:, None] * stride_op + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def default_config(pairs: int, dim: int) -> dict:
    """Block sizes: 16-pair tiles at decode sizes (a few pairs per expert), 64 in prefill; K blocks
    of 64 (less for tiny test widths). Not tuned yet: bench/moe_kernels.py sweeps them."""
    return dict(
        BLOCK_M=16 if pairs <= 1024 else 64,
        BLOCK_N=64,
        BLOCK_K=64 if dim >= 64 else max(16, triton.next_power_of_2(dim)),
    )


def grouped_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    activation: str = "silu",
    config: dict | None = None,
    lora: ExpertDeltas | None = None,
) -> torch.Tensor:
    """The MoE output `[T, hidden]` in `x`'s dtype: sum over each token's k experts of
    `weight * down_e(act(gate_e x) * up_e x)`. `gate_up` `[E, 2 inter, hidden]` (gate rows, then up),
    `down` `[E, hidden, inter]`, `weights` / `experts` `[T, k]` (weights float32 or `x`'s dtype:
    the product with the expert output is rounded to `x`'s dtype either way, as the torch paths do).
    `config`: BLOCK_M, BLOCK_N, BLOCK_K, optionally num_warps, num_stages (default: `default_config`).
    `lora`: LoRA on the experts, its deltas added to each pair's gate_up output before the
    activation and to its down output before the routing weight (`ExpertDeltas`)."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    config = config or default_config(pairs, min(hidden, inter))
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    launch = {k: v for k, v in config.items() if k in ("BLOCK_K", "num_warps", "num_stages")}
    max_tiles = max_tiles_for(pairs, num_experts, block_m)
    order, tile_expert, tile_row, tile_end = moe_tiles_triton(experts, num_experts, block_m, max_tiles)
    n_tiles = tile_expert.numel()
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    delta = lora.gate_up(x).contiguous() if lora is not None else x  # x: a pointer nothing reads
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, block_n))](
        x, gate_up, act, order, tile_expert, tile_row, tile_end, delta,
        num_experts, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), delta.stride(0),
        GELU=activation != "silu", HAS_DELTA=lora is not None, BLOCK_M=block_m, BLOCK_N=block_n, **launch,
    )  # fmt: skip
    if lora is not None:
        # act's rows are in expert order; the delta wants them by (token, slot) pair
        by_pair = torch.empty_like(act).index_copy_(0, order.long(), act)
        delta = lora.down(by_pair).contiguous()
    out = torch.empty(tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    flat_weights = weights.contiguous().view(-1)
    _down_kernel[(n_tiles, triton.cdiv(hidden, block_n))](
        act, down, flat_weights, out, order, tile_expert, tile_row, tile_end, delta,
        num_experts, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), hidden, delta.stride(0),
        HAS_DELTA=lora is not None, BLOCK_M=block_m, BLOCK_N=block_n, **launch,
    )  # fmt: skip
    return out.sum(dim=1)


def grouped_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Torch reference of `grouped_moe`: per expert, float32 matmuls over its routed pairs."""
    tokens, hidden = x.shape
    inter = gate_up.shape[1] // 2
    top_k = experts.shape[1]
    flat = experts.flatten()
    out = torch.zeros(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    for e in torch.unique(flat).tolist():
        pair = (flat == e).nonzero().squeeze(1)
        h = x[pair // top_k].float() @ gate_up[e].float().t()
        gate, up = h[:, :inter], h[:, inter:]
        act_gate = (
            torch.nn.functional.silu(gate)
            if activation == "silu"
            else torch.nn.functional.gelu(gate, approximate="tanh")
        )
        act = (act_gate * up).to(x.dtype)
        y = act.float() @ down[e].float().t()
        out[pair] = (y * weights.flatten()[pair, None].float()).to(x.dtype)
    return out.view(tokens, top_k, hidden).sum(dim=1)
