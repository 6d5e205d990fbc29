"""LoRA expand: `out[t, off_i : off_i+w_i] += scale[s,i] * y[t, i*R : i*R+r] @ B[s, off_i : off_i+w_i, :r]^T`.

One launch covers a whole mixed batch and all `n` stacked modules of a group; the stacks
may have different widths (q/k/v with GQA: q wider than k and v). Programs are (output
column block, token block); each steps over K = the slot's real rank for that stack
(a runtime loop bound), so a rank-4 slot next to a rank-64 one costs rank 4, and a rank-0
module or a token without adapter costs nothing. Each adapter's B is read by one token
block per column block, i.e. once per step for decode.

`y` is shrink's float32 output, `[T, n*R]` or `[S, T, n*R]` (K-split partials, summed
here). It is rounded to B's dtype before the product, as a bf16 PEFT layer does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_configs import ExpandConfig, expand_config
from kernels.lora_meta import LoRASegments, num_blocks_bound

MAX_STACK = 3


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, scal_ptr, sorted_ptr, bslot_ptr, bstart_ptr, bend_ptr,
    max_rank, n_splits,
    sy_s, sy_t, sy_c, sb_s, sb_n, sb_r, so_t, so_n, sr_s, sr_i, ss_s, ss_i,
    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, NB0: tl.constexpr, NB1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    slot = tl.load(bslot_ptr + pid_b)
    if slot < 0:
        return
    # Column blocks never straddle two stacks: stack i owns NB_i = cdiv(W_i, BLOCK_N) blocks.
    stack = (pid_n >= NB0).to(tl.int32) + (pid_n >= NB0 + NB1).to(tl.int32)
    nb = pid_n - tl.where(stack == 0, 0, tl.where(stack == 1, NB0, NB0 + NB1))
    width = tl.where(stack == 0, W0, tl.where(stack == 1, W1, W2))
    col0 = tl.where(stack == 0, 0, tl.where(stack == 1, W0, W0 + W1))
    rank = tl.load(ranks_ptr + slot * sr_s + stack * sr_i)
    if rank == 0:
        return
    scale = tl.load(scal_ptr + slot * ss_s + stack * ss_i)
    start = tl.load(bstart_ptr + pid_b)
    end = tl.load(bend_ptr + pid_b)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    cols = (col0 + offs_n).to(tl.int64)

    y_rows = y_ptr + tok[:, None] * sy_t + stack * max_rank * sy_c
    b_cols = b_ptr + slot.to(tl.int64) * sb_s + cols[None, :] * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, rank, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < rank
        y_mask = m_mask[:, None] & k_mask[None, :]
        yt = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for p in range(0, n_splits):
            yt += tl.load(y_rows + p * sy_s + offs_k[None, :] * sy_c, mask=y_mask, other=0.0)
        bt = tl.load(b_cols + offs_k[:, None] * sb_r, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(yt.to(bt.dtype), bt, acc)
    out_ptrs = out_ptr + tok[:, None] * so_t + cols[None, :] * so_n
    o_mask = m_mask[:, None] & n_mask[None, :]
    prev = tl.load(out_ptrs, mask=o_mask, other=0.0)
    tl.store(out_ptrs, (prev.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def _check_widths(widths: tuple[int, ...], ranks: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> None:
    if not 1 <= len(widths) <= MAX_STACK or len(widths) != ranks.shape[1]:
        raise ValueError(f"widths {widths} must have 1..{MAX_STACK} entries, one per stacked module")
    if sum(widths) != B.shape[1] or sum(widths) != out.shape[1]:
        raise ValueError(f"widths {widths} sum to {sum(widths)}; B has {B.shape[1]}, out {out.shape[1]} rows")


def lora_expand(
    y: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
    config: ExpandConfig | None = None,
) -> torch.Tensor:
    """Triton expand (in place on `out`); see the module docstring. Returns `out`.

    y: float32 `[T, n*R]` or `[S, T, n*R]` from `lora_shrink`; B: `[slots, sum(widths), R]`;
    ranks: int32 `[slots, n]`; scalings: float32 `[slots, n]`; out: `[T, sum(widths)]`.
    config: block sizes; default from the table in `kernels.lora_configs` (benchmarks override).
    """
    _check_widths(widths, ranks, B, out)
    num_tokens = out.shape[0]
    if num_tokens == 0:
        return out
    num_slots, total_width, max_rank = B.shape
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    w = tuple(widths) + (0,) * (MAX_STACK - len(widths))
    cfg = config or expand_config(total_width, len(widths), max_rank, num_tokens)
    bslot, bstart, bend = segs.blocks_for(cfg.block_m)
    n_blocks = sum(triton.cdiv(wi, cfg.block_n) for wi in widths)
    grid = (n_blocks, num_blocks_bound(num_tokens, num_slots, cfg.block_m))
    _expand_kernel[grid](
        y3, B, out, ranks, scalings, segs.sorted_tokens, bslot, bstart, bend,
        max_rank, y3.shape[0],
        y3.stride(0), y3.stride(1), y3.stride(2), B.stride(0), B.stride(1), B.stride(2),
        out.stride(0), out.stride(1), ranks.stride(0), ranks.stride(1),
        scalings.stride(0), scalings.stride(1),
        W0=w[0], W1=w[1], W2=w[2], NB0=triton.cdiv(w[0], cfg.block_n), NB1=triton.cdiv(w[1], cfg.block_n),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def lora_expand_ref(
    y: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    segs: LoRASegments,
    out: torch.Tensor,
    widths: tuple[int, ...],
) -> torch.Tensor:
    """Torch reference with the same contract as `lora_expand` (float32 math, host loop over slots)."""
    _check_widths(widths, ranks, B, out)
    num_tokens = out.shape[0]
    num_slots, _, max_rank = B.shape
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
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
                delta[:, off : off + wi] = scalings[s, i].float() * (ys @ B[s, off : off + wi, :r].float().t())
            off += wi
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
