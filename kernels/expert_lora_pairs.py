"""Expert LoRA per routed pair: `out[p] = scale[s] * B[s, e] @ (A[s, e] @ x[row(p)])` in one launch.

A decode step with LoRA on the experts routes T tokens to k experts each: T * k (token, slot)
pairs, nearly every one of them a different (adapter slot, expert) group. Grouped GEMMs over
`slots * experts` groups spend their time on empty groups (lora/expert_lora_graph.py's padded
`grouped_mm` chunks: 0.43x the base step on the H100 at batch 64 over 8 adapters). Here one
program serves one pair and reads only that pair's factors: its rank-R shrink over the input
width, kept in registers, then the expand over its share of the output columns. The grid is
`(pairs, column splits)` with shapes fixed by the token count, nothing is read on the host, so a
captured decode graph replays it with whatever slots and experts the step brings.

Rows are in pair order (`token * top_k + j`), as kernels/moe_grouped.py's `ExpertDeltas` wants them.
`x` is the layer input `[T, in]` (gate_up: the row of pair p is `p // top_k`) or each pair's
activation `[T * top_k, in]` (down: row p). A pair whose token has no adapter (slot -1), or whose
slot's adapter leaves the module alone (scale 0, factors possibly never written), gets zeros.
Each pair re-reads its group's factors, so this is for decode-sized steps: at a long prefill the
groups repeat and the grouped GEMM reads them once (lora/expert_lora_graph.py's
`PAIR_KERNEL_MAX_PAIRS`).

`expert_pair_lora_ref` is the torch reference (float32, the same contract).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pair_lora_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    slot_scale_ptr,
    experts_ptr,
    token_slots_ptr,
    out_ptr,
    in_dim,
    out_dim,
    num_experts,
    top_k,
    x_row_div,
    cols_per_split,
    stride_x,
    stride_ag,
    stride_ar,
    stride_bg,
    stride_bo,
    stride_out,
    RANK: tl.constexpr,
    R_P2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pair = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(token_slots_ptr + pair // top_k).to(tl.int64)
    scale = tl.load(slot_scale_ptr + tl.maximum(slot, 0)).to(tl.float32)
    # A dead pair (no adapter, or a slot the module's adapter leaves alone) loads nothing: its
    # factors may never have been written, and masked loads give the zeros it stores.
    live = (slot >= 0) & (scale != 0.0)
    expert = tl.load(experts_ptr + pair, mask=live, other=0).to(tl.int64)
    group = tl.maximum(slot, 0) * num_experts + expert
    ranks = tl.arange(0, R_P2)
    rank_ok = ranks < tl.where(live, RANK, 0)
    x_row = x_ptr + (pair // x_row_div).to(tl.int64) * stride_x
    a_rows = a_ptr + group * stride_ag + ranks[:, None] * stride_ar
    v = tl.zeros([R_P2], dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_row + ks, mask=ks < tl.where(live, in_dim, 0), other=0.0).to(tl.float32)
        av = tl.load(a_rows + ks[None, :], mask=rank_ok[:, None] & (ks[None, :] < in_dim), other=0.0)
        v += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    # The shrink is rounded to the factors' dtype before the expand, as a bf16 PEFT forward does.
    v = v.to(a_ptr.dtype.element_ty).to(tl.float32) * scale
    b_rows = b_ptr + group * stride_bg
    out_row = out_ptr + pair.to(tl.int64) * stride_out
    col_lo = split * cols_per_split
    for n0 in range(col_lo, col_lo + cols_per_split, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        bv = tl.load(
            b_rows + cols[:, None] * stride_bo + ranks[None, :],
            mask=(cols[:, None] < out_dim) & rank_ok[None, :],
            other=0.0,
        )
        o = tl.sum(bv.to(tl.float32) * v[None, :], axis=1)
        tl.store(out_row + cols, o.to(out_ptr.dtype.element_ty), mask=cols < out_dim)


def expert_pair_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    top_k: int,
    per_pair_input: bool,
    splits: int = 4,
) -> torch.Tensor:
    """`[T * top_k, out]` in `x`'s dtype; see the module docstring.

    x: `[T, in]` (`per_pair_input=False`) or `[T * top_k, in]`; a: `[S * E, R, in]`; b: `[S * E, out, R]`
    (one layer's pool factors, zeros past each adapter's rank); scale: `[S]` per slot; experts:
    `[T, top_k]`; slots: `[>= T]` each token's slot (-1: none), read on the device only."""
    pairs = experts.numel()
    groups, rank, in_dim = a.shape
    out_dim = b.shape[1]
    out = torch.empty(pairs, out_dim, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    block_n = 64
    splits = max(1, min(splits, triton.cdiv(out_dim, block_n)))
    cols_per_split = triton.cdiv(triton.cdiv(out_dim, splits), block_n) * block_n
    _pair_lora_kernel[(pairs, triton.cdiv(out_dim, cols_per_split))](
        x, a, b, scale, experts.contiguous(), slots, out,
        in_dim, out_dim, groups // scale.shape[0], top_k, 1 if per_pair_input else top_k, cols_per_split,
        x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        RANK=rank, R_P2=triton.next_power_of_2(rank), BLOCK_K=128, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def expert_pair_lora_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    experts: torch.Tensor,
    slots: torch.Tensor,
    top_k: int,
    per_pair_input: bool,
) -> torch.Tensor:
    """Torch reference of `expert_pair_lora` (float32, the shrink rounded to the factors' dtype)."""
    pairs = experts.numel()
    num_experts = a.shape[0] // scale.shape[0]
    pair = torch.arange(pairs, device=x.device)
    slot = slots[pair // top_k].long()
    rows = x[pair if per_pair_input else pair // top_k].float()
    group = slot.clamp(min=0) * num_experts + experts.flatten().long()
    s = scale[slot.clamp(min=0)].float()
    live = (slot >= 0) & (s != 0)
    a_g, b_g = a[group].float(), b[group].float()
    v = torch.einsum("prk,pk->pr", a_g, rows).to(a.dtype).float() * s[:, None]
    out = torch.einsum("por,pr->po", b_g, v)
    return torch.where(live[:, None], out, torch.zeros_like(out)).to(x.dtype)
