"""Fused LoRA shrink->expand: one launch per module group computes
`out[t, off_i : off_i+w_i] += scale[s,i] * (x[t] @ A[s, i*R : i*R+r]^T) @ B[s, off_i : off_i+w_i, :r]^T`
for every token `t` of slot `s` and every stacked module `i`, with the rank-r row kept in registers.

Programs are (output column chunk, token block), over the step's slot-sorted token blocks
(`kernels/lora_meta.py`, built once per step and shared by every layer). A program first computes
its block's `h = x @ A^T` over the whole input width for its chunk's stack (`[BLOCK_M, R]` float32,
never written to memory), rounds it to B's dtype as the two-kernel path and a bf16 PEFT layer do,
then streams its chunk of B and of `out`. Chunks never straddle two stacks, so a group of 3
(q/k/v with GQA widths) is one launch. A program whose slot has rank 0 for its stack, or a block
without a slot, exits at once; loads of A and B are masked to the slot's real rank (B's rounded up
to 8, as in `lora_expand`), so mixed ranks move only their own bytes (no padding to the pool's
max rank, which only shapes the register tile).

The price of fusion: every column chunk of a stack recomputes its tokens' shrink (reads A and x
again, from L2 after the first). `FusedConfig.chunk_n` trades that against parallelism; one chunk
per stack does no extra work.

Modes, as `lora_expand`: `accumulate=True` adds into `out` in its dtype (`prev + scale * acc`);
`accumulate=False` writes the scaled float32 delta (zeros for a stack the slot's adapter does not
target), the LoRA side stream's contract. Rows of tokens without an adapter are never written.
The grid depends only on host-known sizes (no sync): it works inside a captured CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_expand import _check_widths, column_chunks, lora_expand_ref
from loraplex.kernels.lora_meta import LoRASegments, num_blocks_bound
from loraplex.kernels.lora_plan import GroupLaunch
from loraplex.kernels.lora_shrink import lora_shrink_ref
from loraplex.kernels.lora_tiles import _chunk_lora, _put_tile


@triton.jit
def _fused_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scal_ptr,
    block_slot_ptr,
    block_tokens_ptr,
    d,
    max_rank,
    width0,
    width1,
    width2,
    chunks0,
    chunks1,
    chunk_n,
    stride_x_token,
    stride_x_in,
    stride_a_slot,
    stride_a_row,
    stride_a_in,
    stride_b_slot,
    stride_b_out,
    stride_b_rank,
    stride_out_token,
    stride_out_col,
    stride_ranks_slot,
    stride_ranks_stack,
    stride_scal_slot,
    stride_scal_stack,
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    # Slot and tokens are independent loads: one memory round trip for the metadata.
    slot = tl.load(block_slot_ptr + pid_b)
    tok = tl.load(block_tokens_ptr + pid_b * STRIDE_BLOCK_TOKENS + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    stack, chunk, width, col0, rank, scale = _chunk_lora(
        pid_n,
        slot,
        width0,
        width1,
        width2,
        chunks0,
        chunks1,
        ranks_ptr,
        scal_ptr,
        stride_ranks_slot,
        stride_ranks_stack,
        stride_scal_slot,
        stride_scal_stack,
    )
    if ACCUMULATE and rank == 0:
        return  # nothing to add (delta mode goes on and writes the stack's zeros)
    m_mask = tok >= 0
    tok = tl.where(m_mask, tok, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_real = offs_r < rank

    # Shrink: h = x[tok] @ A[slot, stack rows]^T over all of d, in registers. A's rows past the
    # rank are masked (never read), so h's columns past the rank are exact zeros.
    x_rows = x_ptr + tok[:, None] * stride_x_token
    a_rows = (
        a_ptr
        + slot.to(tl.int64) * stride_a_slot
        + (stack * max_rank + offs_r)[None, :].to(tl.int64) * stride_a_row
    )
    k_end = tl.where(rank > 0, d, 0)  # a rank-0 stack (delta mode) reads nothing
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x_ptrs = x_rows + offs_k[None, :] * stride_x_in
        a_ptrs = a_rows + offs_k[:, None] * stride_a_in
        if EVEN_K:  # d is a multiple of BLOCK_K: a K mask would only cost vector width
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_real[None, :], other=0.0)
        else:
            k_mask = offs_k < d
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=k_mask[:, None] & r_real[None, :], other=0.0)
        h = tl.dot(xt, at, h, input_precision=PRECISION)
    hb = h.to(b_ptr.dtype.element_ty)  # rounded as the two-kernel path rounds y

    # Expand: B loads masked to the rank rounded up to 8 (16-byte vectors); the extra rows, stale
    # pool memory, are zeroed in registers (0 * NaN would not be 0).
    rank8 = tl.minimum(tl.multiple_of((rank + 7) // 8 * 8, 8), max_rank)
    r_load = offs_r < rank8
    n_begin = chunk * chunk_n
    n_end = tl.minimum(n_begin + chunk_n, width)
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_r[:, None] * stride_b_rank
    o_rows = out_ptr + tok[:, None] * stride_out_token
    for n0 in range(n_begin, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        cols = (col0 + offs_n).to(tl.int64)
        b_ptrs = b_base + cols[None, :] * stride_b_out
        if EVEN_N:  # every stack width is a multiple of BLOCK_N: no column mask
            bt = tl.load(b_ptrs, mask=r_load[:, None], other=0.0)
            o_mask = m_mask[:, None]
        else:
            n_mask = offs_n < n_end
            bt = tl.load(b_ptrs, mask=r_load[:, None] & n_mask[None, :], other=0.0)
            o_mask = m_mask[:, None] & n_mask[None, :]
        bt = tl.where(r_real[:, None], bt, 0.0)
        acc = tl.dot(hb, bt, input_precision=PRECISION)
        _put_tile(o_rows, cols, o_mask, acc, scale, stride_out_col, ACCUMULATE)


def lora_fused(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
    launch: GroupLaunch,
    accumulate: bool = True,
) -> torch.Tensor:
    """Fused shrink->expand (in place on `out`); see the module docstring. Returns `out`.

    x: `[T, d]`; A: `[slots, n*R, d]`; B: `[slots, sum(widths), R]` (one layer's views of the pool,
    x's dtype); ranks: int32 `[slots, n]`; scalings: float32 `[slots, n]`; segs: built by
    `build_segments` for these T tokens; out: `[T, sum(widths)]` (float32 when `accumulate=False`).
    launch: the group's entry of the step's plan, with `launch.fused` set (block sizes) and the
    distinct-slot bound that sizes the grid.
    """
    cfg = launch.fused
    if cfg is None:
        raise ValueError("lora_fused needs a launch planned with a fused config (launch.fused)")
    _check_widths(widths, ranks, B, out)
    num_tokens, d = x.shape
    if out.shape[0] != num_tokens:
        raise ValueError(f"x has {num_tokens} rows, out {out.shape[0]}")
    if num_tokens == 0:
        return out
    max_rank = B.shape[2]
    w, chunk_n, n_chunks = column_chunks(widths, cfg.chunk_n, cfg.block_n)
    bslot, btok = segs.blocks_for(cfg.block_m)
    # Never past the blocks `build_segments` wrote for this step (the rest are stale).
    distinct = min(launch.distinct_bound, segs.num_slots)
    grid = (sum(n_chunks), num_blocks_bound(num_tokens, distinct, cfg.block_m))
    _fused_kernel[grid](
        x,
        A,
        B,
        out,
        ranks,
        scalings,
        bslot,
        btok,
        d,
        max_rank,
        w[0],
        w[1],
        w[2],
        n_chunks[0],
        n_chunks[1],
        chunk_n,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        out.stride(0),
        out.stride(1),
        ranks.stride(0),
        ranks.stride(1),
        scalings.stride(0),
        scalings.stride(1),
        STRIDE_BLOCK_TOKENS=btok.stride(0),
        # fp32 must stay fp32 (tl.dot defaults to TF32 on GPU); 16-bit inputs ignore it.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=d % cfg.block_k == 0,
        EVEN_N=all(wi % cfg.block_n == 0 for wi in widths),
        ACCUMULATE=accumulate,
        BLOCK_M=cfg.block_m,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_K=cfg.block_k,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def lora_fused_ref(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
    accumulate: bool = True,
) -> torch.Tensor:
    """Torch reference with `lora_fused`'s contract: the shrink and expand references in turn
    (float32 math, the rank-r row rounded to B's dtype between them)."""
    y = torch.zeros(x.shape[0], A.shape[1], dtype=torch.float32, device=x.device)
    lora_shrink_ref(x, A, ranks, segs, y)
    return lora_expand_ref(y, B, ranks, scalings, segs, out, widths, accumulate=accumulate)
