"""LoRA shrink: `y[t, i*R : i*R+r] = x[t] @ A[s, i*R : i*R+r]^T` for every token's slot `s`.

One launch covers a whole mixed batch (decode tokens and prefill segments) and all `n`
stacked modules of a group (q/k/v: n=3, gate/up: n=2). Programs are (stack x rank block,
token block, K-split); a program whose rank block lies past its slot's rank for that
stack exits at once, so a slot's real rank bounds the work and an untargeted module
(rank 0) or a token without adapter (slot -1) costs nothing.

Output `y` is float32, either `[T, n*R]` or `[S, T, n*R]`: with `S` K-splits each split
writes its own partial sum (no atomics, no zeroing pass) and `lora_expand` adds the `S`
partials as it reads them. Entries past a slot's rank, and rows of tokens without an
adapter, are never written. Allocate with `alloc_shrink_out` and take `shrink_out_view`
per step so `S` follows the block-size table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_configs import DECODE_MAX_TOKENS, SPLITS_TABLE, ShrinkConfig, shrink_config, shrink_splits
from kernels.lora_launch import launch_kwargs
from kernels.lora_meta import LoRASegments, num_blocks_bound


# sy_s (one K-split's rows: tokens x columns) follows the step's token count: runtime, not specialised.
@triton.jit(do_not_specialize=["sy_s"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    ranks_ptr,
    bslot_ptr,
    btok_ptr,
    d,
    max_rank,
    k_per_split,
    sx_t,
    sx_d,
    sa_s,
    sa_r,
    sa_d,
    sy_s,
    sy_t,
    sy_c,
    sr_s,
    sr_i,
    R_BLOCKS: tl.constexpr,
    TOK_STRIDE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_sr = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Slot and tokens are independent loads: one memory round trip for the metadata.
    slot = tl.load(bslot_ptr + pid_b)
    tok = tl.load(btok_ptr + pid_b * TOK_STRIDE + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    stack = pid_sr // R_BLOCKS
    r0 = (pid_sr % R_BLOCKS) * BLOCK_R
    rank = tl.load(ranks_ptr + slot * sr_s + stack * sr_i)
    if r0 >= rank:
        return
    if USE_PDL:  # everything above may overlap the previous kernel; nothing below may
        tl.extra.cuda.gdc_wait()
    m_mask = tok >= 0
    tok = tl.where(m_mask, tok, 0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = stack * max_rank + offs_r

    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, d)
    x_rows = x_ptr + tok[:, None] * sx_t
    a_rows = a_ptr + slot.to(tl.int64) * sa_s + rows[None, :].to(tl.int64) * sa_r
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:  # d is a multiple of BLOCK_K: a K mask would only cost vector width
            xt = tl.load(x_rows + offs_k[None, :] * sx_d, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_rows + offs_k[:, None] * sa_d, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < k_end
            xt = tl.load(x_rows + offs_k[None, :] * sx_d, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows + offs_k[:, None] * sa_d, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + pid_k * sy_s + tok[:, None] * sy_t + rows[None, :] * sy_c
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


def alloc_shrink_out(
    max_tokens: int, n_stack: int, max_rank: int, max_d: int, device: torch.device | str
) -> torch.Tensor:
    """Float32 buffer for `lora_shrink`'s output at any step up to `max_tokens` tokens.

    Flat `[rows, n_stack*max_rank]`: a step with S splits and T tokens uses the first S*T
    rows (`shrink_out_view`), so the size is the largest S*T over the table's buckets, not
    S_max * max_tokens. One buffer can serve every group (they run one after another): pass
    `shrink_out_view(buf, d, T)[..., :n*R]` as a group's `y`.
    """
    ds = {max_d} | {dd for (_, dd) in SPLITS_TABLE if dd <= max_d}
    ts = {min(16, max_tokens), min(DECODE_MAX_TOKENS, max_tokens), max_tokens}
    rows = max(shrink_splits(dd, t, many) * t for dd in ds for t in ts for many in (False, True))
    return torch.empty((rows, n_stack * max_rank), dtype=torch.float32, device=device)


def shrink_out_view(buf: torch.Tensor, d: int, num_tokens: int, many: bool = False) -> torch.Tensor:
    """The `[S, T, cols]` view of `alloc_shrink_out`'s buffer that `lora_shrink` fills this step
    (`many`: as for `shrink_splits`).

    Also accepts a `[S_max, max_tokens, cols]` buffer (then it is sliced, not reshaped).
    """
    splits = shrink_splits(d, num_tokens, many)
    if buf.dim() == 3:
        return buf[: min(buf.shape[0], splits), :num_tokens]
    if splits * num_tokens > buf.shape[0]:
        raise ValueError(
            f"shrink buffer has {buf.shape[0]} rows; {splits} splits x {num_tokens} tokens need more"
        )
    return buf[: splits * num_tokens].view(splits, num_tokens, buf.shape[1])


def lora_shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    ranks: torch.Tensor,
    segs: LoRASegments,
    y: torch.Tensor,
    config: ShrinkConfig | None = None,
    max_distinct: int | None = None,
) -> torch.Tensor:
    """Triton shrink; see the module docstring. Returns `y`.

    x: `[T, d]`; A: `[slots, n*R, d]` (one layer's view of the pool, same dtype as x);
    ranks: int32 `[slots, n]`; segs: built by `build_segments` for these T tokens;
    y: float32 `[T, n*R]` or `[S, T, n*R]` (S K-splits = `y.shape[0]`, see `shrink_out_view`).
    config: block sizes; default from the table in `kernels.lora_configs` (benchmarks override).
    max_distinct: at most this many distinct slots among the tokens (None: any): the grid then
    covers only the token blocks such a batch can have, not one per slot.
    """
    num_tokens, d = x.shape
    num_slots, n_rows, _ = A.shape
    n_stack = ranks.shape[1]
    max_rank = n_rows // n_stack
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    splits = y3.shape[0]
    if num_tokens == 0:
        return y
    cfg = config or shrink_config(d, n_stack, max_rank, num_tokens)
    bslot, btok = segs.blocks_for(cfg.block_m)
    r_blocks = triton.cdiv(max_rank, cfg.block_r)
    k_per_split = triton.cdiv(triton.cdiv(d, splits), cfg.block_k) * cfg.block_k
    slots_bound = num_slots if max_distinct is None else min(num_slots, max_distinct)
    grid = (n_stack * r_blocks, num_blocks_bound(num_tokens, slots_bound, cfg.block_m), splits)
    _shrink_kernel[grid](
        x,
        A,
        y3,
        ranks,
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
        R_BLOCKS=r_blocks,
        TOK_STRIDE=btok.stride(0),
        EVEN_K=d % cfg.block_k == 0,
        # fp32 must stay fp32 (tl.dot defaults to TF32 on GPU); 16-bit inputs ignore it.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m,
        BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_kwargs(),
    )
    return y


def lora_shrink_ref(
    x: torch.Tensor,
    A: torch.Tensor,
    ranks: torch.Tensor,
    segs: LoRASegments,
    y: torch.Tensor,
) -> torch.Tensor:
    """Torch reference with the same contract as `lora_shrink` (computes in float32).

    With a `[S, T, n*R]` output the whole sum goes to partial 0 and the others get zeros,
    so the partials add up to the same `y`. Loops over slots on the host (a reference,
    not a fast path).
    """
    num_tokens = x.shape[0]
    num_slots, n_rows, _ = A.shape
    n_stack = ranks.shape[1]
    max_rank = n_rows // n_stack
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
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
