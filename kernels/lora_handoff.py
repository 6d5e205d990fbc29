"""LoRA shrink and expand in one launch, the rank-r partials handed over through memory: the
two-kernel path's arithmetic (`kernels/lora_shrink.py`, then `kernels/lora_expand.py` or its per-token
form) without the kernel boundary between them.

The 1-D grid holds the shrink's programs first, then the expand's. A shrink program writes its K-split
partial of `y` (the same `[S, T, n*R]` float32 buffer the two-kernel path uses), then adds 1 to a counter
per (token, stacked module) of its block with release semantics. An expand program loads its first B
tile, then polls its tokens' counters (acquire) until every shrink program that writes their rank
columns has counted, `cdiv(rank, shrink block_r) * splits` of them, and goes on as `_expand_kernel`
does. The last expand program of a (token, module) puts both of its counters back to 0, so the buffer is
zero again for the next launch (one `alloc_handoff_counters` buffer per backend; launches that share
it run one after another on one stream).

Why it cannot deadlock: a CUDA grid's blocks start in increasing index order, so every shrink program
has started (and runs to its end, waiting for nothing) before any expand program can take an SM to poll.
Under the interpreter the programs run one after another in that order and never wait.

Programs that find no work (a block without a slot, a rank block past the slot's rank, a rank-0 module)
neither count nor wait, on both sides, so mixed ranks keep the no-padding property. With programmatic
dependent launch every program waits for the kernel before it ahead of reading x or the counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_expand import MAX_STACK, _check_widths
from loraplex.kernels.lora_meta import LoRASegments, num_blocks_bound
from loraplex.kernels.lora_plan import GroupLaunch, handoff_fits
from loraplex.kernels.lora_tiles import _b_row_tile, _b_tile, _chunk_lora, _put_row, _put_tile, _shrink_acc
from loraplex.kernels.placement import pdl_launch

# Counter columns per token: one per stacked module (MAX_STACK), padded to 4.
COUNTER_COLS = 4


def alloc_handoff_counters(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 `[2, max_tokens, COUNTER_COLS]` counters (shrink programs counted, expand
    programs done) a `lora_handoff` launch needs; every launch leaves them zero."""
    return torch.zeros((2, max_tokens, COUNTER_COLS), dtype=torch.int32, device=device)


@triton.jit
def _count_shrink(cnt_ptr, tok, m_mask, stack):
    # Every thread's `y` stores come before the release that publishes them.
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + tok * 4 + stack, 1, mask=m_mask, sem="release")


@triton.jit
def _await_shrink(cnt_ptr, tok, m_mask, stack, expected):
    seen = tl.where(m_mask, tl.atomic_add(cnt_ptr + tok * 4 + stack, 0, mask=m_mask, sem="acquire"), expected)
    while tl.min(seen) < expected:
        seen = tl.where(
            m_mask, tl.atomic_add(cnt_ptr + tok * 4 + stack, 0, mask=m_mask, sem="acquire"), expected
        )


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


# stride_y_split (one K-split's rows: tokens x columns) follows the step's token count: a runtime
# value, not specialised on.
@triton.jit(do_not_specialize=["stride_y_split"])
def _handoff_kernel(
    x_ptr,
    a_ptr,
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
    n_shrink,
    d,
    max_rank,
    k_per_split,
    token_blocks,
    width0,
    width1,
    width2,
    chunks0,
    chunks1,
    chunks,
    chunk_n,
    stride_x_token,
    stride_x_in,
    stride_a_slot,
    stride_a_row,
    stride_a_in,
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
    R_BLOCKS: tl.constexpr,
    N_STACK: tl.constexpr,
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SHRINK_BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:
        # Every program has started: the next kernel may launch and do what needs no output of ours.
        tl.extra.cuda.gdc_launch_dependents()
    if pid < n_shrink:
        if PDL:
            tl.extra.cuda.gdc_wait()  # x, and the counters, are the kernel before's to finish
        _shrink_part(
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
            R_BLOCKS,
            N_STACK,
            STRIDE_BLOCK_TOKENS,
            PRECISION,
            EVEN_K,
            BLOCK_M,
            SHRINK_BLOCK_R,
            BLOCK_K,
        )
    else:
        _expand_part(
            pid - n_shrink,
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
            N_SPLITS,
            SHRINK_BLOCK_R,
            STRIDE_BLOCK_TOKENS,
            PRECISION,
            EVEN_N,
            ACCUMULATE,
            PDL,
            PER_TOKEN,
            BLOCK_M,
            BLOCK_N,
            BLOCK_R,
        )


def lora_handoff(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    segs: LoRASegments,
    y: torch.Tensor,
    out: torch.Tensor,
    widths: tuple[int, ...],
    launch: GroupLaunch,
    counters: torch.Tensor,
    accumulate: bool = True,
) -> torch.Tensor:
    """`lora_shrink(x, A, ranks, segs, y, launch)` then `lora_expand(y, B, ranks, scalings, segs, out,
    widths, launch, accumulate)` as one launch (see the module docstring); the same arguments, plus
    `counters` from `alloc_handoff_counters` (at least T rows, zero). Returns `out`."""
    if not handoff_fits(launch):
        raise ValueError(
            "lora_handoff needs the shrink's and the expand's block_m equal, or a per-token expand"
        )
    _check_widths(widths, ranks, B, out)
    num_tokens, d = x.shape
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    if y3.shape[0] != launch.splits:
        raise ValueError(f"y holds {y3.shape[0]} K-split partials; the launch plans {launch.splits}")
    if counters.shape[1] < num_tokens:
        raise ValueError(f"handoff counters hold {counters.shape[1]} tokens; the step has {num_tokens}")
    if num_tokens == 0:
        return out
    n_stack, max_rank = ranks.shape[1], B.shape[2]
    sc, ec = launch.shrink, launch.expand
    bslot, btok = segs.blocks_for(sc.block_m)
    r_blocks = triton.cdiv(max_rank, sc.block_r)
    k_per_split = triton.cdiv(triton.cdiv(d, launch.splits), sc.block_k) * sc.block_k
    token_blocks = num_blocks_bound(num_tokens, min(launch.distinct_bound, segs.num_slots), sc.block_m)
    n_shrink = n_stack * r_blocks * token_blocks * launch.splits
    w = tuple(widths) + (0,) * (MAX_STACK - len(widths))
    chunk_n = max(ec.chunk_n // ec.block_n, 1) * ec.block_n
    n_chunks = [triton.cdiv(wi, chunk_n) for wi in w]
    expand_rows = num_tokens if ec.per_token else token_blocks
    pdl = pdl_launch(out)
    _handoff_kernel[(n_shrink + sum(n_chunks) * expand_rows,)](
        x,
        A,
        y3,
        B,
        out,
        ranks,
        scalings,
        bslot,
        btok,
        segs.token_slots,
        counters[0],
        counters[1],
        n_shrink,
        d,
        max_rank,
        k_per_split,
        token_blocks,
        w[0],
        w[1],
        w[2],
        n_chunks[0],
        n_chunks[1],
        sum(n_chunks),
        chunk_n,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        y3.stride(0),
        y3.stride(1),
        y3.stride(2),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        out.stride(0),
        out.stride(1),
        ranks.stride(0),
        ranks.stride(1),
        scalings.stride(0),
        scalings.stride(1),
        N_SPLITS=launch.splits,
        R_BLOCKS=r_blocks,
        N_STACK=n_stack,
        STRIDE_BLOCK_TOKENS=btok.stride(0),
        # fp32 must stay fp32 (tl.dot defaults to TF32 on GPU); 16-bit inputs ignore it.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=d % sc.block_k == 0,
        EVEN_N=all(wi % ec.block_n == 0 for wi in widths),
        ACCUMULATE=accumulate,
        PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
        PER_TOKEN=bool(ec.per_token),
        BLOCK_M=sc.block_m,
        SHRINK_BLOCK_R=sc.block_r,
        BLOCK_K=sc.block_k,
        BLOCK_N=ec.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        # One program shape serves both parts: the expand's warps (it moves most bytes), the deeper
        # of the two pipelines.
        num_warps=ec.num_warps,
        num_stages=max(sc.num_stages, ec.num_stages),
    )
    return out
