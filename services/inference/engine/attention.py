"""Attention over the paged KV cache: the torch reference path (CPU, unless the Triton kernels are
forced onto it; CUDA runs engine/attention_triton.py).

The KV cache is one tensor `[num_layers, 2, num_blocks, page_size, kv_heads, head_dim]`; a
token at position p of a sequence lives in slot `block_table[p // page_size] * page_size +
p % page_size`. A step's tokens come decodes first (one query token each, batched over a
gathered, padded context), then prefill chunks (one SDPA call each over their whole context).
The Triton path (engine/attention_triton.py) implements `Attention` over the same metadata.
An FP8 cache holds each layer's K and V divided by its scale (engine/kv_cache.py, KVCacheScales),
rounded as kernels/attention_kv_store.py's reference does; reads multiply the scale back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from loraplex.kernels.attention_kv_store import FP8_E4M3, quantize_fp8_ref, store_kv_ref
from loraplex.services.inference.engine.kv_cache import KVCacheScales, kv_cache_scales
from loraplex.services.inference.models.config import ModelConfig
from loraplex.services.inference.models.context import Attention


def effective_windows(config: ModelConfig, context_length: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, None where it is global or the window covers the whole context."""
    return tuple(
        w if w is not None and w < context_length else None
        for w in (config.window_of(i) for i in range(config.num_layers))
    )


class PrefillSegment(NamedTuple):
    q_start: int  # first query token of the segment in the step's token order
    q_len: int
    ctx_start: int  # offset of this segment's context slots in AttentionMetadata.prefill_ctx_slots
    ctx_len: int  # tokens of context, the new ones included (causal: query i sees ctx_len - q_len + i + 1)


class AttentionMetadata(NamedTuple):
    slot_mapping: torch.Tensor  # [T] int64: where each new token's k/v goes
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [B_decode, max_blocks] int64 (padding: 0, masked by length)
    decode_context_lens: torch.Tensor  # [B_decode] int64, the new token included
    prefill_segments: list[PrefillSegment]
    prefill_ctx_slots: torch.Tensor  # [sum ctx_len] int64: cache slots of each segment's context


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes for `index_copy_`, which torch does not implement for FP8 on the CPU."""
    return t.view(torch.uint8) if t.dtype == FP8_E4M3 else t


class TorchPagedAttention(Attention):
    """`windows[layer]`: that layer's sliding window (a query at position p sees keys at positions
    > p - window) or None; `softcap`: scores become `softcap * tanh(scores / softcap)` before the
    mask (Gemma 2). The cache keeps every page either way, so the prefix cache and chunked prefill
    see the same blocks as for a global layer; a window only narrows what is read. `kv_scales`: an
    FP8 cache's per-layer scales (default: unit scales)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        scale: float,
        windows: tuple[int | None, ...] = (),
        softcap: float | None = None,
        kv_scales: KVCacheScales | None = None,
    ):
        self.kv_cache = kv_cache
        self.page_size = kv_cache.shape[3]
        self.scale = scale
        self.windows = windows
        self.softcap = softcap
        self.kv_scales = kv_cache_scales(kv_cache, kv_scales)
        self.meta: AttentionMetadata | None = None

    def _to_cache(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v as the cache holds them (for an FP8 cache: quantized, as bytes)."""
        if self.kv_scales is None:
            return k.to(self.kv_cache.dtype), v.to(self.kv_cache.dtype)
        _, _, k_inv, v_inv = self.kv_scales.layers[layer]
        return quantize_fp8_ref(k, k_inv).view(torch.uint8), quantize_fp8_ref(v, v_inv).view(torch.uint8)

    def _read(self, layer: int, kv: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached k (kv 0) or v (kv 1) rows in `dtype`: an FP8 cache's times the layer's scale."""
        if self.kv_scales is None:
            return rows.to(dtype)
        return (rows.float() * self.kv_scales.layers[layer][kv]).to(dtype)

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor | None = None
    ) -> None:
        """Write the step's new k/v rows into the cache (rows whose slot is < 0 are padding: skipped)."""
        slots = self.meta.slot_mapping if slot_mapping is None else slot_mapping
        inv = self.kv_scales.layers[layer][2:] if self.kv_scales is not None else (None, None)
        store_kv_ref(k, v, self.kv_cache[layer, 0], self.kv_cache[layer, 1], slots[: k.shape[0]], *inv)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's queries over the cache (their own k/v already stored):
        `[T, heads * head_dim]`; rows past the step's tokens (padding) are left as they were."""
        meta = self.meta
        assert meta is not None, "begin() must bind the step's metadata first"
        kv_heads, head_dim = self.kv_cache.shape[4], self.kv_cache.shape[5]
        k_flat = self.kv_cache[layer, 0].view(-1, kv_heads, head_dim)
        v_flat = self.kv_cache[layer, 1].view(-1, kv_heads, head_dim)
        out = torch.empty_like(q) if out is None else out.view(q.shape)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(layer, q[:nd], meta)
        for seg in meta.prefill_segments:
            q_seg = q[seg.q_start : seg.q_start + seg.q_len]
            slots = meta.prefill_ctx_slots[seg.ctx_start : seg.ctx_start + seg.ctx_len]
            out[seg.q_start : seg.q_start + seg.q_len] = self._prefill(
                q_seg,
                self._read(layer, 0, k_flat[slots], q.dtype),
                self._read(layer, 1, v_flat[slots], q.dtype),
                seg,
                self._window(layer),
            )
        return out.reshape(q.shape[0], -1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "begin() must bind the step's metadata first"
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k, v = self._to_cache(layer, k, v)
        _bytes(self.kv_cache[layer, 0]).view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        _bytes(self.kv_cache[layer, 1]).view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        return self.attend(layer, q)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment, window: int | None
    ) -> torch.Tensor:
        if window is not None or self.softcap is not None:
            return self._prefill_eager(q, k, v, seg, window)
        q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if seg.ctx_len == seg.q_len:
            o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            offset = seg.ctx_len - seg.q_len
            q_pos = torch.arange(seg.q_len, device=q.device)[:, None] + offset
            mask = torch.arange(seg.ctx_len, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _prefill_eager(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: PrefillSegment, window: int | None
    ) -> torch.Tensor:
        """Scores written out (SDPA has no soft-capping), computed as transformers' eager attention."""
        heads, kv_heads = q.shape[1], k.shape[1]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        q_pos = torch.arange(seg.q_len, device=q.device)[:, None] + (seg.ctx_len - seg.q_len)
        k_pos = torch.arange(seg.ctx_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def _decode(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, heads, head_dim = q.shape
        tables = meta.decode_block_tables
        k = self.kv_cache[layer, 0][tables].reshape(b, -1, self.kv_cache.shape[4], head_dim)
        v = self.kv_cache[layer, 1][tables].reshape(b, -1, self.kv_cache.shape[4], head_dim)
        kv_heads = k.shape[2]
        qg = q.reshape(b, kv_heads, heads // kv_heads, head_dim).float()
        scores = torch.einsum("bhgd,blhd->bhgl", qg, self._read(layer, 0, k, torch.float32)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        positions = torch.arange(k.shape[1], device=q.device)
        invalid = positions[None, :] >= meta.decode_context_lens[:, None]
        window = self._window(layer)
        if window is not None:  # the query is at position len - 1: keys at <= len - 1 - window are out
            invalid |= positions[None, :] <= meta.decode_context_lens[:, None] - 1 - window
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        # The pages hold stale rows past each context (another request's, a freed block's, a
        # padding entry's): a zero weight times a stale NaN or Inf is NaN, so they are zeroed, not
        # weighed by 0 (the Triton kernel never loads them). One request's values stay in its rows.
        values = self._read(layer, 1, v, torch.float32).masked_fill(invalid[:, :, None, None], 0.0)
        o = torch.einsum("bhgl,blhd->bhgd", probs, values)
        return o.reshape(b, heads, head_dim).to(q.dtype)
