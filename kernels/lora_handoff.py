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

from loraplex.kernels.lora_expand import _check_widths, column_chunks
from loraplex.kernels.lora_handoff_parts import _expand_part, _shrink_part
from loraplex.kernels.lora_meta import LoRASegments
from loraplex.kernels.lora_plan import GroupLaunch, handoff_fits
from loraplex.kernels.lora_shrink import shrink_grid
from loraplex.kernels.placement import pdl_launch

# Counter columns per token: one per stacked module (MAX_STACK), padded to 4.
COUNTER_COLS = 4


def alloc_handoff_counters(max_tokens: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 `[2, max_tokens, COUNTER_COLS]` counters (shrink programs counted, expand
    programs done) a `lora_handoff` launch needs; every launch leaves them zero."""
    return torch.zeros((2, max_tokens, COUNTER_COLS), dtype=torch.int32, device=device)


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
    r_blocks, k_per_split, token_blocks = shrink_grid(num_tokens, d, max_rank, segs, launch)
    n_shrink = n_stack * r_blocks * token_blocks * launch.splits
    w, chunk_n, n_chunks = column_chunks(widths, ec.chunk_n, ec.block_n)
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
