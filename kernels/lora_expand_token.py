"""The LoRA expand with one program per (column chunk, token): `kernels/lora_expand.py`'s contract,
for decode steps where most tokens have their own adapter (`ExpandConfig.per_token`, the `decode_many`
table entries). `lora_expand` launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.lora_tiles import _b_row_tile, _chunk_lora, _put_row


@triton.jit(do_not_specialize=["stride_y_split"])
def _expand_token_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scal_ptr,
    slots_ptr,
    pages_ptr,
    max_rank,
    width0,
    width1,
    width2,
    chunks0,
    chunks1,
    chunk_n,
    stride_y_split,
    stride_y_token,
    stride_y_col,
    stride_b_page,
    stride_b_out,
    stride_b_rank,
    stride_out_token,
    stride_out_col,
    stride_ranks_slot,
    stride_ranks_stack,
    stride_scal_slot,
    stride_scal_stack,
    stride_pages_slot,
    PAGE: tl.constexpr,
    N_SPLITS: tl.constexpr,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """`_expand_kernel` with one program per (column chunk, token): the token's slot straight from
    the step's slots (no segment map), its `y` row, and `[BLOCK_N, R]` tiles of its slot's B reduced
    over the rank in registers (fp32 sums of B-dtype products), no tensor-core tile or shared memory."""
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    if PDL:
        # Every program has started: the next kernel may launch and do what needs no output of ours.
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(slots_ptr + tok)
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
    offs_k = tl.arange(0, BLOCK_R)
    rank8 = tl.minimum(tl.multiple_of((rank + 7) // 8 * 8, 8), max_rank)
    k_load = offs_k < rank8
    k_real = offs_k < rank
    n_begin = chunk * chunk_n
    n_end = tl.minimum(n_begin + chunk_n, width)
    # Each rank row's page (the pool's page table), gathered once before the column loop.
    page = tl.load(pages_ptr + slot * stride_pages_slot + offs_k // PAGE, mask=k_load, other=0)
    b_rows = page.to(tl.int64) * stride_b_page + (offs_k % PAGE).to(tl.int64) * stride_b_rank
    b_base = b_ptr + b_rows[None, :]
    # The first B tile before `y`, as in `_expand_kernel`.
    bt, cols, n_mask = _b_row_tile(
        b_base, col0, n_begin, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N
    )
    if PDL:
        tl.extra.cuda.gdc_wait()  # the shrink's `y` (and the base output, for the in-place add) is complete
    y_row = y_ptr + tok.to(tl.int64) * stride_y_token + (stack * max_rank + offs_k) * stride_y_col
    yv = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for p in tl.static_range(N_SPLITS):
        yv += tl.load(y_row + p * stride_y_split, mask=k_load, other=0.0)
    yv = tl.where(k_real, yv, 0.0).to(b_ptr.dtype.element_ty).to(tl.float32)
    o_row = out_ptr + tok.to(tl.int64) * stride_out_token
    acc = scale * tl.sum(bt * yv[None, :], axis=1)
    _put_row(o_row + cols * stride_out_col, n_mask, acc, ACCUMULATE)
    for n0 in range(n_begin + BLOCK_N, n_end, BLOCK_N):
        bt, cols, n_mask = _b_row_tile(b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N)
        acc = scale * tl.sum(bt * yv[None, :], axis=1)
        _put_row(o_row + cols * stride_out_col, n_mask, acc, ACCUMULATE)
