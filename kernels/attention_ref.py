"""Torch references for the paged attention kernels (slow, obvious, fp32 math).

Also the torch implementations the engine uses where Triton is not available (CPU): they take
exactly the kernels' arguments. Cache layout: `[num_pages, page_size, kv_heads, head_dim]`.
An FP8 cache is dequantized on gather: float32 value times the layer's `k_scale` / `v_scale`.
"""

from __future__ import annotations

import torch


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: `[length, kv_heads, head_dim]`
    (float32 times `scale` when one is given: an FP8 cache)."""
    page_size = cache.shape[1]
    pages = block_table[: -(-length // page_size)].long()
    rows = cache[pages].reshape(-1, *cache.shape[2:])[:length]
    return rows if scale is None else rows.float() * scale


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q `[M, H, D]` at positions `q_pos`, k/v `[N, KVH, D]` at positions 0..N-1; causal (within
    `window` when given), scores soft-capped when `softcap` is given; fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = k_pos <= q_pos[:, None]
    if window:
        visible &= k_pos > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reference for `loraplex.kernels.attention_decode.paged_decode_attention` (0-length rows give zeros)."""
    out = torch.zeros_like(q)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length, k_scale)
        v = gather_kv(v_cache, block_tables[b], length, v_scale)
        pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, pos, scale, window, softcap)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reference for `loraplex.kernels.attention_prefill.paged_prefill_attention`."""
    out = torch.zeros_like(q)
    starts = cu_q.tolist()
    for b, kv_len in enumerate(kv_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[b], kv_len, k_scale)
        v = gather_kv(v_cache, block_tables[b], kv_len, v_scale)
        pos = torch.arange(kv_len - (hi - lo), kv_len, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, pos, scale, window, softcap).to(q.dtype)
    return out
