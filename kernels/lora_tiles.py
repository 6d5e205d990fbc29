"""Building blocks of the LoRA kernels (kernels/lora_shrink.py, kernels/lora_expand.py,
kernels/lora_expand_token.py): the shrink's K loop, which stack a column chunk belongs to, B tiles with the
rank mask, and the output store (the in-place add, or the side stream's delta).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_lora(
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
):
    """For column chunk `pid_n` of a token (block) of `slot`: (stack, chunk within it, stack width,
    stack's first column, the slot's rank for that stack, its scaling, 0 where the rank is 0).
    Chunks never straddle two stacks: stack i owns chunks_i = cdiv(width_i, chunk_n) chunks."""
    stack = (pid_n >= chunks0).to(tl.int32) + (pid_n >= chunks0 + chunks1).to(tl.int32)
    chunk = pid_n - tl.where(stack == 0, 0, tl.where(stack == 1, chunks0, chunks0 + chunks1))
    width = tl.where(stack == 0, width0, tl.where(stack == 1, width1, width2))
    col0 = tl.where(stack == 0, 0, tl.where(stack == 1, width0, width0 + width1))
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + stack * stride_ranks_stack)
    scale = tl.load(scal_ptr + slot * stride_scal_slot + stack * stride_scal_stack)
    return stack, chunk, width, col0, rank, tl.where(rank > 0, scale, 0.0)


@triton.jit
def _b_tile(
    b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr
):
    """B's `[BLOCK_R, BLOCK_N]` tile at columns `n0..` of a stack starting at `col0` (columns past
    the slot's rank zeroed), its global columns and column mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols = (col0 + offs_n).to(tl.int64)
    n_mask = offs_n < n_end
    b_ptrs = b_base + cols[None, :] * stride_b_out
    if EVEN_N:  # every stack width is a multiple of BLOCK_N: no column mask
        bt = tl.load(b_ptrs, mask=k_load[:, None], other=0.0)
    else:
        bt = tl.load(b_ptrs, mask=k_load[:, None] & n_mask[None, :], other=0.0)
    return tl.where(k_real[:, None], bt, 0.0), cols, n_mask


@triton.jit
def _put_tile(o_rows, cols, o_mask, acc, scale, stride_out_col, ACCUMULATE: tl.constexpr):
    o_ptrs = o_rows + cols[None, :] * stride_out_col
    if ACCUMULATE:
        prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(o_ptrs, (prev.to(tl.float32) + scale * acc).to(o_rows.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, (scale * acc).to(o_rows.dtype.element_ty), mask=o_mask)


@triton.jit
def _b_row_tile(
    b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr
):
    """B's `[BLOCK_N, BLOCK_R]` tile at columns `n0..` of a stack starting at `col0`, for one token, in
    float32 (columns past the slot's rank zeroed), its global columns and column mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols = (col0 + offs_n).to(tl.int64)
    n_mask = offs_n < n_end
    b_ptrs = b_base + cols[:, None] * stride_b_out
    if EVEN_N:
        bt = tl.load(b_ptrs, mask=k_load[None, :], other=0.0)
    else:
        bt = tl.load(b_ptrs, mask=n_mask[:, None] & k_load[None, :], other=0.0)
    return tl.where(k_real[None, :], bt.to(tl.float32), 0.0), cols, n_mask


@triton.jit
def _put_row(o_ptrs, n_mask, acc, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        prev = tl.load(o_ptrs, mask=n_mask, other=0.0)
        tl.store(o_ptrs, (prev.to(tl.float32) + acc).to(o_ptrs.dtype.element_ty), mask=n_mask)
    else:
        tl.store(o_ptrs, acc.to(o_ptrs.dtype.element_ty), mask=n_mask)


@triton.jit
def _shrink_acc(
    x_rows,
    a_rows,
    k_begin,
    k_end,
    m_mask,
    r_mask,
    stride_x_in,
    stride_a_in,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`x[tokens, k_begin:k_end] @ A[rows, k_begin:k_end]^T` in float32 (`x_rows`: the tokens' row
    pointers `[BLOCK_M, 1]`; `a_rows`: the rank rows' `[1, BLOCK_R]`; EVEN_K: the input width is a
    multiple of BLOCK_K, so no K mask)."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x_ptrs = x_rows + offs_k[None, :] * stride_x_in
        a_ptrs = a_rows + offs_k[:, None] * stride_a_in
        if EVEN_K:  # a K mask would only cost vector width
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < k_end
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    return acc
