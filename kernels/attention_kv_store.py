"""Write a step's new K and V rows into the paged cache, one launch for both; slot < 0 is skipped.

`slot_mapping[t]` is the flat slot `page * page_size + offset` of token `t`. Skipping negative
slots lets CUDA-graph padding rows (slot -1) run the same launch without touching real pages,
which an `index_copy_` cannot do.

An FP8 (E4M3) cache stores `x * inv_scale` (the layer's float32 reciprocal scale, read from a
device tensor so calibrated scales can be swapped in under captured graphs), clamped to +-448 and
rounded to nearest, ties to even: exactly torch's `.to(torch.float8_e4m3fn)` of the same float32
value (`quantize_fp8_ref`). The rounding is done on the float32 bits with integer operations, not
with Triton's cast: the interpreter's cast does not round to nearest (it can even drop an exponent
carry), and integer rounding gives the same bytes on every backend. Multiplying by a reciprocal
(rather than dividing by the scale) keeps the kernel bit-exact: a float32 product is correctly
rounded everywhere, Triton's `/` is not (div.full.f32 on NVIDIA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_E4M3).max)  # 448


@triton.jit
def fp8_e4m3_bits(x):
    """The E4M3 bit pattern (int32, 0..255) of float32 `x` within +-448, round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    # Normal E4M3 (|x| >= 2^-6, float32 exponent field >= 121): keep 3 of 23 mantissa bits, ties to
    # even (the carry may bump the exponent); rebias 127 -> 7.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal E4M3 (|x| < 2^-6): |x| in units of 2^-9, ties to even; 8 units carry into 2^-6's
    # pattern (0x08) by themselves. Shifts past 25 give 0 anyway, and are clamped to stay defined.
    m = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 21), 25)
    sub = (m + (1 << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift
    return tl.where(exp >= 121, normal, sub) | sign


@triton.jit
def quantize_fp8(x, inv_scale):
    """E4M3 bytes (uint8) of `x * inv_scale`, saturated at +-448, round to nearest even."""
    y = x.to(tl.float32) * inv_scale
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return fp8_e4m3_bits(y).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_inv_scale_ptr,
    v_inv_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_vcp,
    stride_vct,
    stride_vch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:  # the caches come as uint8 views: the bytes are written as computed
        k = quantize_fp8(k, tl.load(k_inv_scale_ptr))
        v = quantize_fp8(v, tl.load(v_inv_scale_ptr))
    tl.store(
        k_cache_ptr + page * stride_cp + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :],
        k,
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + page * stride_vcp
        + offset * stride_vct
        + offs_h[:, None] * stride_vch
        + offs_d[None, :],
        v,
        mask=mask,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_inv_scale: torch.Tensor | None = None,
    v_inv_scale: torch.Tensor | None = None,
) -> None:
    """k, v `[T, kv_heads, head_dim]` into caches `[num_pages, page_size, kv_heads, head_dim]`.
    FP8 caches need `k_inv_scale` / `v_inv_scale`: one-element float32 device tensors, 1 / scale."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous last dimension")
    fp8 = k_cache.dtype == FP8_E4M3
    if fp8:
        if k_inv_scale is None or v_inv_scale is None:
            raise ValueError("an FP8 KV cache needs its k and v inverse scales")
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_inv_scale = v_inv_scale = slot_mapping  # not read
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_inv_scale,
        v_inv_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        FP8=fp8,
        num_warps=2,
    )


def quantize_fp8_ref(x: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """Torch reference of the kernel's FP8 rounding: `x * inv_scale` in float32, saturated at +-448
    (a plain cast turns larger values into NaN), cast with torch's round to nearest even."""
    return (x.float() * inv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_inv_scale: torch.Tensor | float | None = None,
    v_inv_scale: torch.Tensor | float | None = None,
) -> None:
    """Torch reference: the same writes with index_copy_ over the rows whose slot is >= 0 (an FP8
    cache: `quantize_fp8_ref` of the rows, copied as bytes; torch has no FP8 index_copy_ on the CPU)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if k_cache.dtype == FP8_E4M3:
        if k_inv_scale is None or v_inv_scale is None:
            raise ValueError("an FP8 KV cache needs its k and v inverse scales")
        k = quantize_fp8_ref(k, k_inv_scale).view(torch.uint8)
        v = quantize_fp8_ref(v, v_inv_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)
