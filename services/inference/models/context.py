"""What a forward pass needs besides token ids and positions: attention over the KV cache and LoRA."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from loraplex.services.inference.lora.backend import LoRABackend


class Attention(ABC):
    """Attention for one step over the paged KV cache (per-step metadata bound beforehand).

    Contract: `forward(layer, q, k, v)` gets the step's tokens in forward order (`q`: [T, heads,
    head_dim], `k`/`v`: [T, kv_heads, head_dim], already rotated), writes `k`/`v` into that
    layer's cache at the step's slots, and returns causal attention over each sequence's whole
    context (earlier pages included) as [T, heads * head_dim]. No host syncs.
    """

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    # The two halves of `forward`, for steps that run everything but attention in CUDA graphs
    # (engine/mixed_graphs.py): `store` the new k/v (inside a graph, with a static slot mapping whose
    # padding rows are -1), then `attend` eagerly, into `out` (a static buffer) when given.
    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor | None = None
    ) -> None:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def fused_store_target(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """(k_cache, v_cache, slot_mapping) of `layer`, plus (k_inv_scale, v_inv_scale) for an FP8
        cache, for the q/k/v split launch to write the new k/v into itself (then `attend` follows,
        not `forward`); None: `forward` stores them."""
        return None


class ForwardContext(NamedTuple):
    attention: Attention
    lora: LoRABackend | None  # None when no token of the batch has an adapter
