"""LoRA shrink: `y[t, i*R : i*R+r] = x[t] @ A_s,i[:r]^T` for every token's slot `s`.

`A_s,i` is read through the pool's page table (services/inference/lora/pool.py): rank row `j` of
stack `i` of slot `s` is row `i*P + j % P` of page `pages[s, j // P]` of `A` `[pages, n*P, d]`. Each
program gathers the page ids of its rank block once (one int load per row); its K loop then reads
whole rows, contiguous along `d`, as before.

One launch covers a whole mixed batch (decode tokens and prefill segments) and all `n`
stacked modules of a group (q/k/v: n=3, gate/up: n=2). Programs are (stack x rank block,
token block, K-split); a program whose rank block lies past its slot's rank for that
stack exits at once, so a slot's real rank bounds the work and an untargeted module
(rank 0) or a token without adapter (slot -1) costs nothing.

Output `y` is float32, either `[T, n*R]` or `[S, T, n*R]`: with `S` K-splits each split
writes its own partial sum (no atomics, no zeroing pass) and `lora_expand` adds the `S`
partials as it reads them. Entries past a slot's rank, and rows of tokens without an
adapter, are never written. Allocate with `alloc_shrink_out` and take `shrink_out_view`
per step with the step plan's split count (`loraplex.kernels.lora_plan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_configs import DECODE_MAX_TOKENS, SPLITS_TABLE, shrink_splits
from loraplex.kernels.lora_meta import LoRASegments, num_blocks_bound
from loraplex.kernels.lora_pages import unpage_a
from loraplex.kernels.lora_plan import GroupLaunch
from loraplex.kernels.lora_tiles import _shrink_acc
from loraplex.kernels.placement import pdl_launch


# stride_y_split (one K-split's rows: tokens x columns) follows the step's token count: a runtime
# value, not specialised on.
@triton.jit(do_not_specialize=["stride_y_split"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    ranks_ptr,
    pages_ptr,
    block_slot_ptr,
    block_tokens_ptr,
    d,
    max_rank,
    k_per_split,
    stride_x_token,
    stride_x_in,
    stride_a_page,
    stride_a_row,
    stride_a_in,
    stride_y_split,
    stride_y_token,
    stride_y_col,
    stride_ranks_slot,
    stride_ranks_stack,
    stride_pages_slot,
    R_BLOCKS: tl.constexpr,
    PAGE: tl.constexpr,
    STRIDE_BLOCK_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_sr = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    if PDL:
        # Programmatic dependent launch: the expand may launch once every program here has started
        # (it reads only what was written before this kernel until it waits for our `y`); x, and
        # anything the kernel before wrote, is complete only past the wait.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # Slot and tokens are independent loads: one memory round trip for the metadata.
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
    rows = stack * max_rank + offs_r  # y's columns
    # The page of each rank row (rows past the rank read page 0's entry: masked below).
    page = tl.load(pages_ptr + slot * stride_pages_slot + offs_r // PAGE, mask=r_mask, other=0)
    a_rows = page.to(tl.int64) * stride_a_page + (stack * PAGE + offs_r % PAGE).to(tl.int64) * stride_a_row

    k_begin = pid_k * k_per_split
    acc = _shrink_acc(
        x_ptr + tok[:, None] * stride_x_token,
        a_ptr + a_rows[None, :],
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
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


def alloc_shrink_out(
    max_tokens: int, n_stack: int, max_rank: int, max_d: int, device: torch.device | str
) -> torch.Tensor:
    """Float32 buffer for `lora_shrink`'s output at any step up to `max_tokens` tokens.

    Flat `[rows, n_stack*max_rank]`: a step with S splits and T tokens uses the first S*T
    rows (`shrink_out_view`), so the size is the largest S*T over the table's buckets, not
    S_max * max_tokens. One buffer can serve every group (they run one after another): pass
    `shrink_out_view(buf, launch.splits, T)[..., :n*R]` as a group's `y`.
    """
    ds = {max_d} | {key.in_features for key in SPLITS_TABLE if key.in_features <= max_d}
    ts = {min(16, max_tokens), min(DECODE_MAX_TOKENS, max_tokens), max_tokens}
    rows = max(shrink_splits(dd, t, many) * t for dd in ds for t in ts for many in (False, True))
    return torch.empty((rows, n_stack * max_rank), dtype=torch.float32, device=device)


def shrink_out_view(buf: torch.Tensor, splits: int, num_tokens: int) -> torch.Tensor:
    """The `[splits, T, cols]` view of `alloc_shrink_out`'s buffer that `lora_shrink` fills for a
    group launched with `splits` K-splits (`GroupLaunch.splits`)."""
    if splits * num_tokens > buf.shape[0]:
        raise ValueError(
            f"shrink buffer has {buf.shape[0]} rows; {splits} splits x {num_tokens} tokens need more"
        )
    return buf[: splits * num_tokens].view(splits, num_tokens, buf.shape[1])


class ShrinkGrid(NamedTuple):
    r_blocks: int  # rank blocks per stacked module
    k_per_split: int  # input columns per K-split, a multiple of block_k
    token_blocks: int  # token blocks the step can have


def shrink_grid(
    num_tokens: int, d: int, max_rank: int, segs: LoRASegments, launch: GroupLaunch
) -> ShrinkGrid:
    """The shrink's program grid per stacked module."""
    cfg = launch.shrink
    return ShrinkGrid(
        r_blocks=triton.cdiv(max_rank, cfg.block_r),
        k_per_split=triton.cdiv(triton.cdiv(d, launch.splits), cfg.block_k) * cfg.block_k,
        # Never past the blocks `build_segments` wrote for this step (the rest are stale).
        token_blocks=num_blocks_bound(num_tokens, min(launch.distinct_bound, segs.num_slots), cfg.block_m),
    )


def lora_shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    ranks: torch.Tensor,
    pages: torch.Tensor,
    segs: LoRASegments,
    y: torch.Tensor,
    launch: GroupLaunch,
) -> torch.Tensor:
    """Triton shrink; see the module docstring. Returns `y`.

    x: `[T, d]`; A: `[pages, n*P, d]` (one layer's view of the pool's pages, same dtype as x);
    ranks: int32 `[slots, n]`; pages: int32 `[slots, ceil(R/P)]`, the pool's page table;
    segs: built by `build_segments` for these T tokens;
    y: float32 `[launch.splits, T, n*R]` (`shrink_out_view`), or `[T, n*R]` with one split.
    launch: the group's entry of the step's plan (`loraplex.kernels.lora_plan`): K-splits, block sizes
    (`launch.shrink`) and the distinct-slot bound that sizes the grid.
    """
    num_tokens, d = x.shape
    n_stack = ranks.shape[1]
    page_rows = A.shape[1] // n_stack
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    max_rank = y3.shape[2] // n_stack
    if y3.shape[0] != launch.splits:
        raise ValueError(f"y holds {y3.shape[0]} K-split partials; the launch plans {launch.splits}")
    if num_tokens == 0:
        return y
    cfg = launch.shrink
    bslot, btok = segs.blocks_for(cfg.block_m)
    r_blocks, k_per_split, token_blocks = shrink_grid(num_tokens, d, max_rank, segs, launch)
    pdl = pdl_launch(x)
    _shrink_kernel[(n_stack * r_blocks, token_blocks, launch.splits)](
        x,
        A,
        y3,
        ranks,
        pages,
        bslot,
        btok,
        d,
        max_rank,
        k_per_split,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        y3.stride(0),
        y3.stride(1),
        y3.stride(2),
        ranks.stride(0),
        ranks.stride(1),
        pages.stride(0),
        R_BLOCKS=r_blocks,
        PAGE=page_rows,
        STRIDE_BLOCK_TOKENS=btok.stride(0),
        EVEN_K=d % cfg.block_k == 0,
        PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
        # fp32 must stay fp32 (tl.dot defaults to TF32 on GPU); 16-bit inputs ignore it.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m,
        BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


def lora_shrink_ref(
    x: torch.Tensor,
    A: torch.Tensor,
    ranks: torch.Tensor,
    pages: torch.Tensor,
    segs: LoRASegments,
    y: torch.Tensor,
) -> torch.Tensor:
    """Torch reference with the same contract as `lora_shrink` (computes in float32): the pages are
    gathered back into each slot's `[n*R, d]` rows first (`kernels/lora_pages.py`).

    With a `[S, T, n*R]` output the whole sum goes to partial 0 and the others get zeros,
    so the partials add up to the same `y`. Loops over slots on the host (a reference,
    not a fast path).
    """
    num_tokens = x.shape[0]
    n_stack = ranks.shape[1]
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    max_rank = y3.shape[2] // n_stack
    A = unpage_a(A, pages, n_stack, max_rank)
    num_slots = A.shape[0]
    slots = segs.token_slots[:num_tokens].to(torch.int64)
    col_rank = ranks.to(torch.int64).repeat_interleave(max_rank, dim=1)  # [slots, n*R]
    col_in_rank = torch.arange(max_rank, device=A.device).repeat(n_stack)[None, :] < col_rank
    xf = x.float()
    for s in range(num_slots):
        rows = (slots == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        mask = col_in_rank[s][None, :].expand(rows.numel(), -1)
        full = xf[rows] @ A[s].float().t()
        for p in range(y3.shape[0]):
            value = full if p == 0 else torch.zeros_like(full)
            y3[p, rows] = torch.where(mask, value.to(y3.dtype), y3[p, rows])
    return y
