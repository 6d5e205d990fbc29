"""The two halves of the one-launch LoRA handoff (`kernels/lora_handoff.py`): a shrink program that
writes its K-split partial of `y` and counts it, an expand program that waits for its tokens' counts
and then runs as the expand kernels do, and the counters' release/acquire helpers. A token's counters
are 4 int32 columns, one per stacked module (`lora_handoff.COUNTER_COLS`)."""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.lora_tiles import _b_row_tile, _b_tile, _chunk_lora, _put_row, _put_tile, _shrink_acc


@triton.jit
def _count_shrink(cnt_ptr, tok, m_mask, stack):
    # Every thread's `y` stores come before the release that publishes them.
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + tok * 4 + stack, 1, mask=m_mask, sem="release")


@triton.jit
def _await_shrink(cnt_ptr, tok, m_mask, stack, expected):
    # The loop carries a scalar: Triton 3.6 fails to lay out a while loop that carries a tensor.
    ptrs = cnt_ptr + tok * 4 + stack
    short = tl.min(tl.where(m_mask, tl.atomic_add(ptrs, 0, mask=m_mask, sem="acquire"), expected)) < expected
    while short:
        seen = tl.atomic_add(ptrs, 0, mask=m_mask, sem="acquire")
        short = tl.min(tl.where(m_mask, seen, expected)) < expected


@triton.jit
def _release_counters(cnt_ptr, done_ptr, tok, m_mask, stack, programs):
    """The last of a (token, module)'s `programs` expand programs zeroes both of its counters."""
    done = tl.atomic_add(done_ptr + tok * 4 + stack, 1, mask=m_mask, sem="relaxed")
    last = m_mask & (done == programs - 1)
    tl.store(cnt_ptr + tok * 4 + stack, tl.zeros_like(done), mask=last)
    tl.store(done_ptr + tok * 4 + stack, tl.zeros_like(done), mask=last)


@triton.jit
def _shrink_part(
    pid,
    x_ptr,
    a_ptr,
    y_ptr,
    ranks_ptr,
    block_slot_ptr,
    block_tokens_ptr,
    cnt_ptr,
    d,
    max_rank,
    k_per_split,
    token_blocks,
    stride_x_token,
    stride_x_in,
    stride_a_slot,
    stride_a_row,
    stride_a_in,
    stride_y_split,
    stride_y_token,
    stride_y_col,
    stride_ranks_slot,
    stride_ranks_stack,
    R_BLOCKS: tl.constexpr,
    N_STACK: tl.constexpr,
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The shrink kernel's grid (stack x rank block, token block, K-split), x fastest.
    pid_sr = pid % (N_STACK * R_BLOCKS)
    pid_b = (pid // (N_STACK * R_BLOCKS)) % token_blocks
    pid_k = pid // (N_STACK * R_BLOCKS * token_blocks)
    slot = tl.load(block_slot_ptr + pid_b)
    tok = tl.load(block_tokens_ptr + pid_b * STRIDE_BLOCK_TOKENS + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    stack = pid_sr // R_BLOCKS
    r0 = (pid_sr % R_BLOCKS) * BLOCK_R
    rank = tl.load(ranks_ptr + slot * stride_ranks_slot + stack * stride_ranks_stack)
    if r0 >= rank:
        return
    m_mask = tok >= 0
    tok = tl.where(m_mask, tok, 0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = stack * max_rank + offs_r
    k_begin = pid_k * k_per_split
    acc = _shrink_acc(
        x_ptr + tok[:, None] * stride_x_token,
        a_ptr + slot.to(tl.int64) * stride_a_slot + rows[None, :].to(tl.int64) * stride_a_row,
        k_begin,
        tl.minimum(k_begin + k_per_split, d),
        m_mask,
        r_mask,
        stride_x_in,
        stride_a_in,
        PRECISION,
        EVEN_K,
        BLOCK_M,
        BLOCK_R,
        BLOCK_K,
    )
    y_ptrs = y_ptr + pid_k * stride_y_split + tok[:, None] * stride_y_token + rows[None, :] * stride_y_col
    tl.store(y_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])
    _count_shrink(cnt_ptr, tok, m_mask, stack)


@triton.jit
def _expand_part(
    pid,
    y_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scal_ptr,
    block_slot_ptr,
    block_tokens_ptr,
    token_slots_ptr,
    cnt_ptr,
    done_ptr,
    max_rank,
    width0,
    width1,
    width2,
    chunks0,
    chunks1,
    chunks,
    chunk_n,
    stride_y_split,
    stride_y_token,
    stride_y_col,
    stride_b_slot,
    stride_b_out,
    stride_b_rank,
    stride_out_token,
    stride_out_col,
    stride_ranks_slot,
    stride_ranks_stack,
    stride_scal_slot,
    stride_scal_stack,
    N_SPLITS: tl.constexpr,
    SHRINK_BLOCK_R: tl.constexpr,
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # The expand kernel's grid (column chunk, token block or token), x fastest.
    pid_n = pid % chunks
    pid_b = pid // chunks
    if PER_TOKEN:
        slot = tl.load(token_slots_ptr + pid_b)
        tok = tl.full((1,), 0, tl.int32) + pid_b
    else:
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
        return
    m_mask = tok >= 0
    tok = tl.where(m_mask, tok, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_R)
    rank8 = tl.minimum(tl.multiple_of((rank + 7) // 8 * 8, 8), max_rank)
    k_load = offs_k < rank8
    k_real = offs_k < rank
    n_begin = chunk * chunk_n
    n_end = tl.minimum(n_begin + chunk_n, width)
    # The first B tile before waiting: the adapters' weights were written before the launch.
    if PER_TOKEN:
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_k[None, :] * stride_b_rank
        bt, cols, n_mask = _b_row_tile(
            b_base, col0, n_begin, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N
        )
    else:
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot + offs_k[:, None] * stride_b_rank
        bt, cols, n_mask = _b_tile(
            b_base, col0, n_begin, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N
        )
    if PDL:
        tl.extra.cuda.gdc_wait()  # the counters (and, in place, `out`) are the kernel before's to finish
    if rank > 0:
        _await_shrink(cnt_ptr, tok, m_mask, stack, tl.cdiv(rank, SHRINK_BLOCK_R) * N_SPLITS)
    # `y` bypasses L1: the shrink programs wrote it during this launch.
    cols_y = (stack * max_rank + offs_k) * stride_y_col
    if PER_TOKEN:
        y_row = y_ptr + pid_b.to(tl.int64) * stride_y_token + cols_y
        yv = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for p in tl.static_range(N_SPLITS):
            yv += tl.load(y_row + p * stride_y_split, mask=k_load, other=0.0, cache_modifier=".cg")
        yv = tl.where(k_real, yv, 0.0).to(b_ptr.dtype.element_ty).to(tl.float32)
        o_row = out_ptr + pid_b.to(tl.int64) * stride_out_token
        _put_row(o_row + cols * stride_out_col, n_mask, scale * tl.sum(bt * yv[None, :], axis=1), ACCUMULATE)
        for n0 in range(n_begin + BLOCK_N, n_end, BLOCK_N):
            bt, cols, n_mask = _b_row_tile(
                b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N
            )
            _put_row(
                o_row + cols * stride_out_col, n_mask, scale * tl.sum(bt * yv[None, :], axis=1), ACCUMULATE
            )
    else:
        y_ptrs = y_ptr + tok[:, None] * stride_y_token + cols_y[None, :]
        y_mask = m_mask[:, None] & k_load[None, :]
        yt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p in tl.static_range(N_SPLITS):
            yt += tl.load(y_ptrs + p * stride_y_split, mask=y_mask, other=0.0, cache_modifier=".cg")
        yt = tl.where(k_real[None, :], yt, 0.0).to(b_ptr.dtype.element_ty)
        o_rows = out_ptr + tok[:, None] * stride_out_token
        o_mask = m_mask[:, None] if EVEN_N else m_mask[:, None] & n_mask[None, :]
        _put_tile(
            o_rows, cols, o_mask, tl.dot(yt, bt, input_precision=PRECISION), scale, stride_out_col, ACCUMULATE
        )
        for n0 in range(n_begin + BLOCK_N, n_end, BLOCK_N):
            bt, cols, n_mask = _b_tile(b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N)
            o_mask = m_mask[:, None] if EVEN_N else m_mask[:, None] & n_mask[None, :]
            acc = tl.dot(yt, bt, input_precision=PRECISION)
            _put_tile(o_rows, cols, o_mask, acc, scale, stride_out_col, ACCUMULATE)
    if rank > 0:
        stack_chunks = tl.where(
            stack == 0, chunks0, tl.where(stack == 1, chunks1, chunks - chunks0 - chunks1)
        )
        _release_counters(cnt_ptr, done_ptr, tok, m_mask, stack, stack_chunks)
