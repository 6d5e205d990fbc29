"""Attention over the paged KV cache with the Triton kernels of kernels/attention_*.py (CUDA).

Same metadata and contract as `TorchPagedAttention` (engine/attention.py): decodes first, then
prefill chunks. Decodes go through the split-K paged decode kernel, all prefill chunks of the
step through one paged prefill launch (chunked prefill over earlier pages included), and the
new K/V through one store launch per layer that skips slot -1 (CUDA-graph padding rows).
Per-step work (the prefill chunks' page tables) happens once in `begin`, never per layer.
An FP8 cache: the store quantizes with the layer's inverse scale, the attention kernels read FP8
and multiply the layer's scales back in registers (KVCacheScales: static buffers, graph-safe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.kernels.attention_decode import paged_decode_attention
from loraplex.kernels.attention_kv_store import store_kv
from loraplex.kernels.attention_prefill import paged_prefill_attention
from loraplex.services.inference.engine.attention import AttentionMetadata
from loraplex.services.inference.engine.kv_cache import KVCacheScales, kv_cache_scales
from loraplex.services.inference.models.context import Attention


class _PrefillBatch(NamedTuple):
    block_tables: torch.Tensor  # [segments, max pages] int32
    cu_q: torch.Tensor  # [segments + 1] int32, relative to the first prefill token
    kv_lens: torch.Tensor  # [segments] int32
    max_q_len: int


class TritonPagedAttention(Attention):
    """`windows` / `softcap`: as `TorchPagedAttention`'s (per-layer sliding windows, Gemma 2's
    soft-capping); both are kernel arguments, so a windowed layer reads only its window's pages.
    `kv_scales`: an FP8 cache's per-layer scales (default: unit scales)."""

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
        # per layer: (k scale, v scale, k inverse, v inverse), or Nones for a float cache
        self._scales = self.kv_scales.layers if self.kv_scales is not None else None
        self.meta: AttentionMetadata | None = None
        self.prefill: _PrefillBatch | None = None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.prefill = self._prefill_batch(meta) if meta.prefill_segments else None

    def _prefill_batch(self, meta: AttentionMetadata) -> _PrefillBatch:
        page, nd = self.page_size, meta.num_decode_tokens
        segs = meta.prefill_segments
        max_pages = max(-(-s.ctx_len // page) for s in segs)
        # A segment's context slots are its pages in order, so every page-th slot names a page.
        pages = torch.zeros(len(segs), max_pages, dtype=torch.int64, device=self.kv_cache.device)
        for i, s in enumerate(segs):
            firsts = meta.prefill_ctx_slots[s.ctx_start : s.ctx_start + s.ctx_len : page]
            pages[i, : firsts.shape[0]] = firsts // page
        cu = [segs[0].q_start - nd]
        for s in segs:
            cu.append(cu[-1] + s.q_len)
        dev = self.kv_cache.device
        return _PrefillBatch(
            pages.to(torch.int32),
            torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
            torch.tensor([s.ctx_len for s in segs], dtype=torch.int32).to(dev, non_blocking=True),
            max(s.q_len for s in segs),
        )

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor | None = None
    ) -> None:
        """Write the step's new k/v rows into the cache (slot < 0: padding, skipped)."""
        slots = self.meta.slot_mapping if slot_mapping is None else slot_mapping
        inv = self._scales[layer][2:] if self._scales is not None else (None, None)
        store_kv(k, v, self.kv_cache[layer, 0], self.kv_cache[layer, 1], slots, *inv)

    def fused_store_target(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """The cache of `layer` and the step's slots (and an FP8 cache's inverse scales), for the q/k/v
        split launch to store into (one launch fewer per layer than a separate store)."""
        target = (self.kv_cache[layer, 0], self.kv_cache[layer, 1], self.meta.slot_mapping)
        return target + tuple(self._scales[layer][2:]) if self._scales is not None else target

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's queries over the cache (their own k/v already stored):
        `[T, heads * head_dim]`; rows past the step's tokens (padding) are left as they were."""
        meta = self.meta
        assert meta is not None, "begin() must bind the step's metadata first"
        k_cache, v_cache = self.kv_cache[layer, 0], self.kv_cache[layer, 1]
        out = torch.empty_like(q) if out is None else out.view(q.shape)
        opts = {"window": self.windows[layer] if self.windows else None, "softcap": self.softcap}
        if self._scales is not None:
            opts["k_scale"], opts["v_scale"] = self._scales[layer][:2]
        nd = meta.num_decode_tokens
        if nd:
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                out=out[:nd],
                **opts,
            )
        if self.prefill is not None:
            p = self.prefill
            paged_prefill_attention(
                q[nd:],
                k_cache,
                v_cache,
                p.block_tables,
                p.cu_q,
                p.kv_lens,
                self.scale,
                p.max_q_len,
                out=out[nd:],
                **opts,
            )
        return out.reshape(q.shape[0], -1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store(layer, k, v)
        return self.attend(layer, q)
