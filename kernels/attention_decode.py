"""Paged decode attention, flash-decoding style: one query token per sequence over its KV pages.

KV cache layout (per layer): `k_cache`, `v_cache` shaped `[num_pages, page_size, kv_heads,
head_dim]`; `block_tables[b, i]` is the page holding tokens `[i*page_size, (i+1)*page_size)`
of sequence `b`; `context_lens[b]` counts its tokens (the new one included, already written).

Work split: program `(b, kv_head, split)` handles every query head of one GQA group (so each
K/V byte is read once per step, not once per query head) over one contiguous slice of the
context. `num_splits` depends only on the batch shape, never on the contexts, so the launch is
the same for every step of a captured CUDA graph; the slice length is computed in the kernel
from `context_lens`. A second kernel merges the splits by their log-sum-exp.

An FP8 (E4M3) cache is read as FP8 (half the bytes of bf16) and converted to the query's dtype in
registers (exact: every E4M3 value is a bf16/fp16 value); the layer's scales (one-element float32
device tensors, so calibrated scales can change under a captured graph) are folded in after the
dots: the K scale into the softmax scale, the V scale into the split's output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.fused_ops import tanh

LOG2E = 1.4426950408889634


@triton.jit
def soft_cap(s, cap):
    """`cap * tanh(s / cap)`: Gemma 2's attention logit soft-capping."""
    return cap * tanh(s / cap)


# The split count is a runtime value (it follows the batch size, and a constexpr would compile a
# variant per batch size while serving); only the padded width of the merge is compiled in.
@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,  # an FP8 cache's dots in fp16 (E4M3 -> fp16 is one instruction, -> bf16 three)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if KV_FP8:  # dequantize: q.(s_k k8) = s_k (q.k8)
        k_scale = tl.load(k_scale_ptr)
        scale = scale * k_scale
        scale_log2 = scale_log2 * k_scale
    ctx = tl.load(lens_ptr + b)
    # A sliding window (window > 0) leaves the keys at positions > ctx - 1 - window: the splits
    # share that span, so a windowed layer reads at most `window` keys however long the context.
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F16_DOT:  # K and V convert to q's dtype below; fp16 holds every E4M3 value exactly
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(tables_ptr + b * stride_tb + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        if SOFTCAP:
            s = soft_cap(tl.dot(q, tl.trans(k)) * scale, softcap) * 1.4426950408889634
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    # An empty split (short context) leaves l_i = 0: it writes lse = -inf and weighs nothing.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DIRECT:  # the only split: `mid_o` is the output (dtype, strides of `out`), no merge follows
        tl.store(
            mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(mid_o_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
        return
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(
        mid_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    parts = tl.load(
        mid_o_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # A sequence with no tokens (a CUDA-graph padding row) gets zeros, not NaN.
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_outb + h * stride_outh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def fp8_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(whether the cache is FP8, the scale pointers to pass): a float cache's are not read."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return False, k_cache, k_cache
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs its k and v scales")
    return True, k_scale, v_scale


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_SPLITS = 32


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so the grid covers the GPU about twice (a function of shape only)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    programs = max(1, batch * num_kv_heads)
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, programs)))


def decode_block_n(batch: int, num_kv_heads: int, kv_fp8: bool = False) -> int:
    """Keys per tile: over a bf16 cache 64 (with 3 stages, at least as fast as 32-key tiles at every
    batch, 7-10% faster at batch 256); over an FP8 cache (half the bytes a tile) 128 from 128 programs
    (batch 16 at 8 kv heads), 64 below (docs/benchmarks.md, "Facts behind defaults")."""
    if kv_fp8:
        return 128 if batch * num_kv_heads >= 128 else 64
    return 64


def decode_num_stages(block_n: int, kv_fp8: bool, head_dim: int = 128) -> int:
    """Pipeline depth: 3 for an FP8 cache's 128-key tiles and a bf16 cache's 64-key tiles up to head
    dim 128 (both measured fastest at batch 16-256), else 2 (three stages of 64 keys at head dim 256
    would ask for more shared memory than some GPUs have)."""
    if kv_fp8:
        return 3 if block_n >= 128 else 2
    return 3 if block_n <= 64 and head_dim <= 128 else 2


def decode_variants(
    max_batch: int, num_kv_heads: int, device: torch.device, kv_fp8: bool = False
) -> dict[tuple[int, int], int]:
    """The compiled variants (block_n, padded split count) a decode batch of 1..`max_batch` can
    launch, each with the smallest batch size that launches it: what a warm-up must run."""
    out: dict[tuple[int, int], int] = {}
    for b in range(1, max_batch + 1):
        splits = decode_num_splits(b, num_kv_heads, device)
        out.setdefault((decode_block_n(b, num_kv_heads, kv_fp8), triton.next_power_of_2(splits)), b)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    f16_dot: bool | None = None,
) -> torch.Tensor:
    """Attention of `q` `[B, heads, head_dim]` over each sequence's paged K/V; returns `[B, heads, head_dim]`.
    `window`: only keys at positions > len - 1 - window (a sliding-window layer); `softcap`: scores
    become `softcap * tanh(scores / softcap)`. An FP8 cache needs `k_scale` / `v_scale` (one-element
    float32 device tensors: a cached value times its scale is the real one); `f16_dot` (None: on for
    an FP8 cache and bf16 q) runs its dots in fp16, q rounded to fp16 and clamped to its range.

    `block_tables` `[B, max_pages]` int32, `context_lens` `[B]` int32 (0 = padding row: zeros out).
    No host sync: safe inside a captured CUDA graph.
    """
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    group = num_heads // num_kv_heads
    splits = num_splits or decode_num_splits(batch, num_kv_heads, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    kv_fp8, k_scale, v_scale = fp8_scales(k_cache, k_scale, v_scale)
    if block_n is None:
        block_n = decode_block_n(batch, num_kv_heads, kv_fp8)
    if num_stages is None:
        num_stages = decode_num_stages(block_n, kv_fp8, head_dim)
    block_d = triton.next_power_of_2(head_dim)
    # Partials sized for the padded split count: their strides (kernel arguments whose value class
    # Triton specialises on) then follow the padded count, as the merge's compiled width does, so the
    # warm-up's one batch per (block_n, padded count) covers them (`decode_variants`).
    pad = triton.next_power_of_2(splits)
    if out is None:
        out = torch.empty_like(q)
    # One split writes the output itself (the same rounding as the merge's divide by one), saving the
    # merge launch and the float32 partials' round trip.
    direct = splits == 1
    if direct:
        mid_o, mid_lse = out.unsqueeze(2), out  # [B, heads, 1, head_dim] view; lse never written
    else:
        mid_o = torch.empty((batch, num_heads, pad, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, num_heads, pad), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        mid_o,
        mid_lse,
        k_scale,
        v_scale,
        scale * LOG2E,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        scale,
        softcap or 1.0,
        window or 0,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        SOFTCAP=softcap is not None,
        DIRECT=direct,
        KV_FP8=kv_fp8,
        F16_DOT=kv_fp8 and (q.dtype == torch.bfloat16 if f16_dot is None else f16_dot),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if direct:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS_PAD=pad,
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
