"""The Triton LoRA backend: one shrink and one expand launch per group, over the whole mixed batch.

`prepare` builds the slot-sorted segments into preallocated device buffers with device ops
only (CUDA-graph safe); `apply` reads the pool's per-slot rank and scaling tables on the
device, so a slot's real rank bounds the work and untargeted modules cost nothing.
"""

from __future__ import annotations

import torch

from kernels.lora_expand import lora_expand
from kernels.lora_meta import alloc_segments, build_segments
from kernels.lora_shrink import alloc_shrink_out, lora_shrink, shrink_out_view
from services.inference.lora.backend import GROUPS, LoRABackend
from services.inference.lora.pool import AdapterPool


class TritonLoRABackend(LoRABackend):
    cuda_graph_safe = True

    def __init__(self, pool: AdapterPool, max_tokens: int):
        self.pool = pool
        self.max_tokens = max_tokens
        self.segments = alloc_segments(max_tokens, pool.slots, pool.device)
        max_d = max((pool.shapes.group_in(g) for g in pool.groups), default=1)
        max_stack = max((len(GROUPS[g]) for g in pool.groups), default=1)
        # One float32 shrink buffer shared by all groups (they run one after another).
        self._shrink_buf = alloc_shrink_out(max_tokens, max_stack, pool.max_rank, max_d, pool.device)
        self._widths = {g: pool.shapes.group_widths(g) for g in pool.groups}
        self._num_tokens = 0

    @property
    def nbytes(self) -> int:
        """Device bytes of the per-step buffers (metadata and the shrink output)."""
        return self._shrink_buf.numel() * 4 + sum(t.numel() * t.element_size() for t in self.segments)

    def prepare(self, token_slots: torch.Tensor) -> None:
        build_segments(token_slots, self.segments)
        self._num_tokens = token_slots.shape[0]

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if group not in self._widths:
            return
        pool = self.pool
        n_cols = len(GROUPS[group]) * pool.max_rank
        y = shrink_out_view(self._shrink_buf, x.shape[1], self._num_tokens)[..., :n_cols]
        ranks = pool.rank[group][layer]
        lora_shrink(x, pool.lora_a[group][layer], ranks, self.segments, y)
        lora_expand(y, pool.lora_b[group][layer], ranks, pool.scaling[group][layer], self.segments, out,
                    self._widths[group])
