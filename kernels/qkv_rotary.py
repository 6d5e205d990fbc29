"""The q/k/v split with rotary embedding in one launch on CUDA: the fused linear's output (plus its
LoRA delta) split into q, k and v, Qwen3 / Gemma 3's per-head q/k norms, rotary on q and k, and
optionally k and v stored straight into the paged cache (an FP8 cache too: the bytes the separate
store, kernels/attention_kv_store.py, would write); `qkv_rotary_ref` is the torch code it replaces
(services/inference/models/llama.py, rope.py), rounding where it rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.attention_kv_store import FP8_E4M3, quantize_fp8, store_kv_ref
from loraplex.kernels.fused_ops import _scale_normed, rms_norm_ref


@triton.jit
def _cache_value(x, inv_ptr, cache_ptr, KV_FP8: tl.constexpr):
    """`x` as the cache stores it: E4M3 bytes of `x * inv_scale` for an FP8 cache, else cast."""
    if KV_FP8:
        return quantize_fp8(x, tl.load(inv_ptr))
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _qkv_rotary_kernel(
    qkv_ptr,
    d_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    qn_ptr,
    kn_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    k_inv_ptr,
    v_inv_ptr,
    stride_t,
    stride_dt,
    stride_ct,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_kcp,
    stride_kct,
    stride_kch,
    stride_vcp,
    stride_vct,
    stride_vch,
    eps,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    QK_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    STORE_KV: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 16,
    KV_FP8: tl.constexpr = False,  # the caches are uint8 views of E4M3: values scaled, rounded, saturated
):
    t = tl.program_id(0)
    part = tl.program_id(1)  # 0: q, 1: k (both rotated), 2: v (only its LoRA delta added)
    dim = 2 * HALF
    heads = tl.where(part == 0, Q_HEADS, KV_HEADS)
    col0 = tl.where(part == 0, 0, tl.where(part == 1, Q_HEADS * dim, (Q_HEADS + KV_HEADS) * dim))
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    cols = col0 + offs_h[:, None] * dim + offs_d[None, :]
    x1 = tl.load(qkv_ptr + t * stride_t + cols, mask=mask, other=0.0)
    x2 = tl.load(qkv_ptr + t * stride_t + cols + HALF, mask=mask, other=0.0)
    dt = q_ptr.dtype.element_ty
    if HAS_DELTA:  # the projection's LoRA delta, rounded in as the in-place add does
        x1 = (x1.to(tl.float32) + tl.load(d_ptr + t * stride_dt + cols, mask=mask, other=0.0)).to(dt)
        x2 = (x2.to(tl.float32) + tl.load(d_ptr + t * stride_dt + cols + HALF, mask=mask, other=0.0)).to(dt)
    heads_d = offs_h[:, None] * dim + offs_d[None, :]
    if STORE_KV:  # the fused KV store: k and v go to their cache slot (slot < 0: padding, skipped)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        page = slot // PAGE_SIZE
        kv_mask = mask & ((offs_h[:, None] * 0 + slot) >= 0)  # a broadcast mask (the interpreter)
    if part == 2:
        if STORE_KV:
            dst = vc_ptr + page * stride_vcp + (slot % PAGE_SIZE) * stride_vct + offs_h[:, None] * stride_vch
            tl.store(dst + offs_d[None, :], _cache_value(x1, v_inv_ptr, vc_ptr, KV_FP8), mask=kv_mask)
            tl.store(dst + offs_d[None, :] + HALF, _cache_value(x2, v_inv_ptr, vc_ptr, KV_FP8), mask=kv_mask)
        else:
            tl.store(v_ptr + t * stride_vt + heads_d, x1, mask=mask)
            tl.store(v_ptr + t * stride_vt + heads_d + HALF, x2, mask=mask)
    else:
        if QK_NORM:  # Qwen3 / Gemma 3: each head of q and k RMS-normalised (over both halves) first
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
            d_mask = offs_d < HALF
            is_q = part == 0
            w1 = tl.where(
                is_q,
                tl.load(qn_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32),
                tl.load(kn_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32),
            )[None, :]
            w2 = tl.where(
                is_q,
                tl.load(qn_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32),
                tl.load(kn_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32),
            )[None, :]
            x1 = _scale_normed(f1, rstd, w1, dt, UNIT_OFFSET)
            x2 = _scale_normed(f2, rstd, w2, dt, UNIT_OFFSET)
        c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        # torch rounds each product and each sum to the tensor dtype: do the same.
        a = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        b = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
        if part == 0:
            tl.store(q_ptr + t * stride_qt + heads_d, a, mask=mask)
            tl.store(q_ptr + t * stride_qt + heads_d + HALF, b, mask=mask)
        elif STORE_KV:
            dst = kc_ptr + page * stride_kcp + (slot % PAGE_SIZE) * stride_kct + offs_h[:, None] * stride_kch
            tl.store(dst + offs_d[None, :], _cache_value(a, k_inv_ptr, kc_ptr, KV_FP8), mask=kv_mask)
            tl.store(dst + offs_d[None, :] + HALF, _cache_value(b, k_inv_ptr, kc_ptr, KV_FP8), mask=kv_mask)
        else:
            tl.store(k_ptr + t * stride_kt + heads_d, a, mask=mask)
            tl.store(k_ptr + t * stride_kt + heads_d + HALF, b, mask=mask)


def qkv_rotary(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    delta: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
    kv_cache: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split the fused q/k/v projection `[T, (q_heads + 2 kv_heads) * head_dim]` (last dim contiguous)
    into q, k, v `[T, heads, head_dim]` with the half-split rotary applied to q and k (`cos`/`sin`
    `[T, head_dim/2]` in qkv's dtype), after adding the projection's float32 LoRA `delta` (same
    width, any row stride) when given. One launch. q and k are new tensors; v is a view of `qkv`
    without a delta, else a new tensor. `out`: (q, k, v) to write instead (v is then always written).
    `kv_cache`: (k_cache, v_cache `[pages, page_size, kv_heads, head_dim]`, slot_mapping `[T]`, and for
    an FP8 cache k_inv_scale, v_inv_scale as `store_kv` takes them): k and v are written into the
    cache at each token's slot instead (slot < 0 skipped), and come back None."""
    tokens, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    half = dim // 2
    if kv_cache is not None:
        q = (
            out[0]
            if out is not None
            else torch.empty((tokens, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
        )
        k = v = None
        k_cache, v_cache, slots, *inv_scales = kv_cache
    elif out is not None:
        q, k, v = out
    else:
        q = torch.empty((tokens, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((tokens, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
        if delta is None:
            v = qkv[:, (q_heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        else:
            v = torch.empty((tokens, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        cos, sin = cos.contiguous(), sin.contiguous()
        d = qkv if delta is None else delta
        qn, kn, eps, unit_offset = qk_norm if qk_norm is not None else (qkv, qkv, 0.0, False)
        store = kv_cache is not None
        if store:
            if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
                raise ValueError("the caches need a contiguous last dimension")
            cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
            page_size = k_cache.shape[1]
            kv_fp8 = k_cache.dtype == FP8_E4M3
            if kv_fp8:
                if len(inv_scales) != 2:
                    raise ValueError("an FP8 KV cache needs its k and v inverse scales")
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            else:
                inv_scales = (slots, slots)  # not read
        else:  # unused cache arguments: fixed dummies, so no new specialisation per token count
            k_cache, v_cache, slots = q, q, qkv
            cache_strides, page_size, kv_fp8, inv_scales = (0,) * 6, 16, False, (qkv, qkv)
        kk, vv = (q, q) if store else (k, v)
        # Program 2 writes v (plus its delta): needed with a delta, when v is not a view of qkv, or
        # into the cache.
        _qkv_rotary_kernel[(tokens, 2 if delta is None and out is None and not store else 3)](
            qkv,
            d,
            cos,
            sin,
            q,
            kk,
            vv,
            qn,
            kn,
            k_cache,
            v_cache,
            slots,
            *inv_scales,
            qkv.stride(0),
            d.stride(0),
            cos.stride(0),
            q.stride(0),
            kk.stride(0),
            vv.stride(0),
            *cache_strides,
            eps,
            Q_HEADS=q_heads,
            KV_HEADS=kv_heads,
            HALF=half,
            BLOCK_H=triton.next_power_of_2(q_heads),
            BLOCK_D=triton.next_power_of_2(half),
            HAS_DELTA=delta is not None,
            QK_NORM=qk_norm is not None,
            UNIT_OFFSET=unit_offset,
            STORE_KV=store,
            PAGE_SIZE=page_size,
            KV_FP8=kv_fp8,
            num_warps=4,
        )
    return q, k, v


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qkv_rotary_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    delta: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
    kv_cache: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The torch code `qkv_rotary` replaces: in-place delta add, split, q/k norms, rotary of q and k
    (and, with `kv_cache`, the separate store of k and v, which then come back None)."""
    if delta is not None:
        qkv = qkv.clone().add_(delta)
    tokens, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    q, k, v = qkv.split((q_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.reshape(tokens, q_heads, dim), k.reshape(tokens, kv_heads, dim)
    if qk_norm is not None:
        qw, kw, eps, unit_offset = qk_norm
        q, k = rms_norm_ref(q, qw, eps, unit_offset), rms_norm_ref(k, kw, eps, unit_offset)
    result = (rotary_ref(q, cos, sin), rotary_ref(k, cos, sin), v.reshape(tokens, kv_heads, dim))
    if kv_cache is not None:
        store_kv_ref(result[1], result[2], *kv_cache)
        q = result[0] if out is None else out[0].copy_(result[0])
        return q, None, None
    if out is None:
        return result
    for dst, src in zip(out, result, strict=True):
        dst.copy_(src)
    return out
