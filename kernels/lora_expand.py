"""LoRA expand: `out[t, off_i : off_i+w_i] += scale[s,i] * y[t, i*R : i*R+r] @ B_s[:r, off_i : off_i+w_i]`.

`B_s` is read through the pool's page table (services/inference/lora/pool.py): rank row `j` of slot
`s` is row `j % P` of page `pages[s, j // P]` of `B` `[pages, P, sum(w)]`, contiguous along the output
width. A program gathers its rank rows' page ids once, before its column loop.

One launch covers a whole mixed batch and all `n` stacked modules of a group; the stacks
may have different widths (q/k/v with GQA: q wider than k and v). Programs are (output
column chunk, token block); each loads its tokens' `y` once and then streams its chunk
of B and of `out` in `block_n` steps (software-pipelined). Loads of `y` and B are masked
to the slot's real rank (rounded up to 8), so a rank-4 slot next to a rank-64 one moves rank-4 bytes (the
tile math is padded to the pool's max rank, which only matters where compute does:
never for decode, and under the `out` stream for prefill); a rank-0 module or a token
without adapter exits before any load. Each adapter's B is read once per token block,
i.e. once per step for decode.

`y` is shrink's float32 output, `[T, n*R]` or `[S, T, n*R]` (K-split partials, summed
here). It is rounded to B's dtype before the product, as a bf16 PEFT layer does.

With `accumulate=False` the kernel writes the scaled delta itself into a float32 `out`
(zeros for a stack the slot's adapter does not target) instead of adding it to the base
output: the delta can then be computed on a second stream while the base matmul runs and
added afterwards (`out = dtype(float(base) + delta)`: the in-place sum's rounding, except that
a GPU may contract the in-place `prev + scale * acc` into one fused multiply-add).
Rows of tokens without an adapter are not written in either mode.

A plan entry with `per_token` launches `kernels/lora_expand_token.py`'s kernel instead (one program per
token and column chunk); the tiles both kernels share are in `kernels/lora_tiles.py`. On Hopper both
launch with programmatic dependent launch: a program loads its first B tile, then
waits for the shrink's `y`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_expand_token import _expand_token_kernel
from loraplex.kernels.lora_meta import LoRASegments, num_blocks_bound
from loraplex.kernels.lora_pages import unpage_b
from loraplex.kernels.lora_plan import GroupLaunch
from loraplex.kernels.lora_tiles import _b_tile, _chunk_lora, _put_tile
from loraplex.kernels.placement import pdl_launch

MAX_STACK = 3


# stride_y_split (one K-split's rows: tokens x columns) follows the step's token count: a runtime
# value, not specialised on.
@triton.jit(do_not_specialize=["stride_y_split"])
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    ranks_ptr,
    scal_ptr,
    block_slot_ptr,
    block_tokens_ptr,
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
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    if PDL:
        # Every program has started: the next kernel may launch and do what needs no output of ours.
        tl.extra.cuda.gdc_launch_dependents()
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
    # y (the K-split partials summed) is loaded once per program; columns past the slot's
    # rank are masked, so the bytes read (y here, B below) scale with the real rank.
    offs_k = tl.arange(0, BLOCK_R)
    # Loads are masked to the rank rounded up to 8 so the mask is constant over 16-byte
    # vectors (a mask at the exact rank forces 2-byte loads); the extra columns, which
    # nobody wrote, are then zeroed in registers.
    rank8 = tl.minimum(tl.multiple_of((rank + 7) // 8 * 8, 8), max_rank)
    k_load = offs_k < rank8
    k_real = offs_k < rank
    n_begin = chunk * chunk_n
    n_end = tl.minimum(n_begin + chunk_n, width)
    page = tl.load(pages_ptr + slot * stride_pages_slot + offs_k // PAGE, mask=k_load, other=0)
    b_rows = page.to(tl.int64) * stride_b_page + (offs_k % PAGE).to(tl.int64) * stride_b_rank
    b_base = b_ptr + b_rows[:, None]
    # The first B tile before `y`: under programmatic dependent launch (PDL) this program may start
    # while the shrink still runs, and B, the ranks and the step's segments were all written before it.
    bt, cols, n_mask = _b_tile(b_base, col0, n_begin, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the shrink's `y` (and the base output, for the in-place add) is complete
    y_ptrs = y_ptr + tok[:, None] * stride_y_token + (stack * max_rank + offs_k)[None, :] * stride_y_col
    y_mask = m_mask[:, None] & k_load[None, :]
    yt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for p in tl.static_range(N_SPLITS):
        yt += tl.load(y_ptrs + p * stride_y_split, mask=y_mask, other=0.0)
    yt = tl.where(k_real[None, :], yt, 0.0).to(b_ptr.dtype.element_ty)

    o_rows = out_ptr + tok[:, None] * stride_out_token
    o_mask = m_mask[:, None] if EVEN_N else m_mask[:, None] & n_mask[None, :]
    acc = tl.dot(yt, bt, input_precision=PRECISION)
    _put_tile(o_rows, cols, o_mask, acc, scale, stride_out_col, ACCUMULATE)
    for n0 in range(n_begin + BLOCK_N, n_end, BLOCK_N):
        bt, cols, n_mask = _b_tile(b_base, col0, n0, n_end, k_load, k_real, stride_b_out, EVEN_N, BLOCK_N)
        o_mask = m_mask[:, None] if EVEN_N else m_mask[:, None] & n_mask[None, :]
        acc = tl.dot(yt, bt, input_precision=PRECISION)
        _put_tile(o_rows, cols, o_mask, acc, scale, stride_out_col, ACCUMULATE)


def _check_widths(widths: tuple[int, ...], ranks: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> None:
    if not 1 <= len(widths) <= MAX_STACK or len(widths) != ranks.shape[1]:
        raise ValueError(f"widths {widths} must have 1..{MAX_STACK} entries, one per stacked module")
    if sum(widths) != B.shape[2] or sum(widths) != out.shape[1]:
        raise ValueError(
            f"widths {widths} sum to {sum(widths)}; B has {B.shape[2]}, out {out.shape[1]} columns"
        )


class ColumnChunks(NamedTuple):
    widths: tuple[int, ...]  # the stacks' widths, padded with 0 to MAX_STACK
    chunk_n: int  # columns per program, a multiple of the block width
    per_stack: tuple[int, ...]  # each stack's chunks (a chunk never straddles two stacks)


def column_chunks(widths: tuple[int, ...], chunk_n: int, block_n: int) -> ColumnChunks:
    """How a group's output columns split into programs (the expand grid)."""
    w = tuple(widths) + (0,) * (MAX_STACK - len(widths))
    chunk = max(chunk_n // block_n, 1) * block_n
    return ColumnChunks(w, chunk, tuple(triton.cdiv(wi, chunk) for wi in w))


def lora_expand(
    y: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    pages: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
    launch: GroupLaunch,
    accumulate: bool = True,
) -> torch.Tensor:
    """Triton expand (in place on `out`); see the module docstring. Returns `out`.

    y: float32 `[launch.splits, T, n*R]` from `lora_shrink` (or `[T, n*R]` with one split);
    B: `[pages, P, sum(widths)]` (one layer's view of the pool's pages); ranks: int32 `[slots, n]`;
    scalings: float32 `[slots, n]`; pages: int32 `[slots, ceil(R/P)]`, the pool's page table;
    out: `[T, sum(widths)]` (float32 when `accumulate=False`: it receives the delta instead of
    having it added). launch: the group's entry of the step's plan (`loraplex.kernels.lora_plan`): the
    K-split partials to add, block sizes (`launch.expand`) and the distinct-slot bound that sizes
    the grid.
    """
    _check_widths(widths, ranks, B, out)
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    if y3.shape[0] != launch.splits:
        raise ValueError(f"y holds {y3.shape[0]} K-split partials; the launch plans {launch.splits}")
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return out
    max_rank = y3.shape[2] // ranks.shape[1]
    cfg = launch.expand
    w, chunk_n, n_chunks = column_chunks(widths, cfg.chunk_n, cfg.block_n)
    # Arguments after the slot metadata, the same for both kernels.
    shape_args = (
        max_rank,
        w[0],
        w[1],
        w[2],
        n_chunks[0],
        n_chunks[1],
        chunk_n,
        y3.stride(0),
        y3.stride(1),
        y3.stride(2),
        B.stride(0),
        B.stride(2),
        B.stride(1),
        out.stride(0),
        out.stride(1),
        ranks.stride(0),
        ranks.stride(1),
        scalings.stride(0),
        scalings.stride(1),
        pages.stride(0),
    )
    pdl = pdl_launch(out)
    common = dict(
        PAGE=B.shape[1],
        N_SPLITS=launch.splits,
        EVEN_N=all(wi % cfg.block_n == 0 for wi in widths),
        ACCUMULATE=accumulate,
        PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
        BLOCK_N=cfg.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.per_token:
        _expand_token_kernel[(sum(n_chunks), num_tokens)](
            y3, B, out, ranks, scalings, segs.token_slots, pages, *shape_args, **common
        )
        return out
    bslot, btok = segs.blocks_for(cfg.block_m)
    # Never past the blocks `build_segments` wrote for this step (the rest are stale).
    distinct = min(launch.distinct_bound, segs.num_slots)
    grid = (sum(n_chunks), num_blocks_bound(num_tokens, distinct, cfg.block_m))
    _expand_kernel[grid](
        y3,
        B,
        out,
        ranks,
        scalings,
        bslot,
        btok,
        pages,
        *shape_args,
        STRIDE_BLOCK_TOKENS=btok.stride(0),
        # fp32 must stay fp32 (tl.dot defaults to TF32 on GPU); 16-bit inputs ignore it.
        PRECISION="ieee" if B.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m,
        **common,
    )
    return out


def lora_expand_ref(
    y: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    pages: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
    accumulate: bool = True,
) -> torch.Tensor:
    """Torch reference with the same contract as `lora_expand` (float32 math, host loop over slots;
    the pages gathered back into each slot's `[W, R]` first: `kernels/lora_pages.py`)."""
    _check_widths(widths, ranks, B, out)
    num_tokens = out.shape[0]
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    max_rank = y3.shape[2] // ranks.shape[1]
    B = unpage_b(B, pages, max_rank)
    num_slots = B.shape[0]
    slots = segs.token_slots[:num_tokens].to(torch.int64)
    rank_list = ranks.tolist()
    for s in range(num_slots):
        rows = (slots == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        delta = torch.zeros(rows.numel(), out.shape[1], dtype=torch.float32, device=out.device)
        off = 0
        for i, wi in enumerate(widths):
            r = rank_list[s][i]
            if r > 0:
                ys = y3[:, rows, i * max_rank : i * max_rank + r].sum(0)
                ys = ys.to(B.dtype).float()
                delta[:, off : off + wi] = scalings[s, i].float() * (
                    ys @ B[s, off : off + wi, :r].float().t()
                )
            off += wi
        out[rows] = (out[rows].float() + delta).to(out.dtype) if accumulate else delta.to(out.dtype)
    return out
