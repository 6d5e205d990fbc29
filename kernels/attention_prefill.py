"""Paged prefill attention for chunked prefill: a chunk of new queries over all of its sequence's pages.

Queries are packed: sequence `b` owns rows `[cu_q[b], cu_q[b+1])` of `q` `[T, heads, head_dim]`.
Its K/V (earlier chunks and this chunk, already written) live in the paged cache
(`[num_pages, page_size, kv_heads, head_dim]`, `block_tables[b]`), `kv_lens[b]` tokens long.
Query row `i` of the chunk sits at position `kv_lens[b] - q_len + i` and sees keys up to it
(causal). One program handles `BLOCK_M` queries of one head; heads vary fastest in the grid so
the heads of one GQA group run side by side and share K/V tiles in L2. An FP8 cache is dequantized
in registers as in kernels/attention_decode.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.attention_decode import fp8_scales, soft_cap

LOG2E = 1.4426950408889634


# The page tables' row stride is the step's longest chunk in pages: a runtime value, not a value
# class to compile a variant for (1 page, a multiple of 16, other).
@triton.jit(do_not_specialize=["stride_tb", "window"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    cu_q_ptr,
    kv_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_tb,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    h = tl.program_id(0)
    m_block = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    if KV_FP8:  # dequantize: q.(s_k k8) = s_k (q.k8)
        k_scale = tl.load(k_scale_ptr)
        scale = scale * k_scale
        scale_log2 = scale_log2 * k_scale
    kv_len = tl.load(kv_lens_ptr + b)
    kvh = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = kv_len - q_len + offs_m
    q = tl.load(
        q_ptr + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the block's last query are never visible.
    kv_end = tl.minimum(kv_len, kv_len - q_len + m0 + BLOCK_M)
    # With a sliding window, keys before the block's first query's window are never visible either.
    kv_start = tl.where(window > 0, tl.maximum(kv_len - q_len + m0 - window + 1, 0), 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
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
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (offs_n[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that see nothing yet (padding rows past q_len) keep m = -inf; avoid -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunk queries `q` `[T, heads, head_dim]` over the paged cache.

    `cu_q` `[B+1]` int32 query offsets, `kv_lens` `[B]` int32 (>= each chunk's length),
    `max_q_len` the longest chunk (host-side; it sizes the grid). Returns `[T, heads, head_dim]`.
    `window`: a query at position p sees keys at positions > p - window; `softcap`: scores become
    `softcap * tanh(scores / softcap)` before the mask. An FP8 cache needs `k_scale` / `v_scale`
    (one-element float32 device tensors).
    """
    total, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    batch = cu_q.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    kv_fp8, k_scale, v_scale = fp8_scales(k_cache, k_scale, v_scale)
    grid = (num_heads, triton.cdiv(max_q_len, block_m), batch)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_q,
        kv_lens,
        k_scale,
        v_scale,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        scale,
        softcap or 1.0,
        window or 0,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SOFTCAP=softcap is not None,
        KV_FP8=kv_fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
