"""AdapterWeights: one adapter version in host memory, as adapter_loader.py reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.lora.embedding_lora import EmbeddingLoRA
from loraplex.services.inference.lora.trainable_tokens import TokenRows

if TYPE_CHECKING:
    from loraplex.services.inference.lora.packed_groups import PackedGroup


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter version in host memory: per-(layer, module) A `[r, in]` and B `[out, r]`; on
    the experts (lora/expert_targets.py) per-(layer, expert module) A `[E, r, in]` and B `[E, out, r]`."""

    spec: AdapterSpec
    targets: dict[tuple[int, str], ModuleLoRA]
    lora_a: dict[tuple[int, str], torch.Tensor]
    lora_b: dict[tuple[int, str], torch.Tensor]
    digest: str
    chat_template: str | None = None  # the adapter's own, read at load time (None: the model's)
    expert_targets: dict[tuple[int, str], ModuleLoRA] = field(default_factory=dict)
    expert_a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    expert_b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # DoRA (lora/dora.py): per-(layer, module) magnitude `[out]` float32, as read; and the factor
    # `m / ||W + sBA||` per row, filled once from the base weights (`dora.fill_factors`) before upload.
    dora_magnitude: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    dora_factor: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # LoRA on "model.embed_tokens" / "lm_head" (lora/embedding_lora.py)
    embedding: dict[str, EmbeddingLoRA] = field(default_factory=dict)
    # trainable tokens (lora/trainable_tokens.py): per "model.embed_tokens" / "lm_head", its own rows
    token_rows: dict[str, TokenRows] = field(default_factory=dict)
    # per module group, the A/B above packed for a two-copy upload (lora/packed_groups.py); empty: the
    # pool copies per (layer, module). Whoever replaces lora_a / lora_b must drop it.
    packed: dict[str, PackedGroup] = field(default_factory=dict)

    @property
    def has_vocab_parts(self) -> bool:
        """Whether the adapter changes the embedding or lm_head (served on one device only)."""
        return bool(self.embedding) or bool(self.token_rows)

    @property
    def all_targets(self) -> dict[tuple[int, str], ModuleLoRA]:
        """The linear targets and the expert targets together (what the server's limits check)."""
        return {**self.targets, **self.expert_targets}

    @property
    def max_rank(self) -> int:
        ranks = [t.rank for t in self.all_targets.values()] + [
            int(e.a.shape[0]) for e in self.embedding.values()
        ]
        return max(ranks)

    @property
    def nbytes(self) -> int:
        """Host bytes held, each storage once (A/B may be views into `packed`; a fused module's parts
        share one A)."""
        tensors = [
            t
            for d in (
                self.lora_a,
                self.lora_b,
                self.expert_a,
                self.expert_b,
                self.dora_magnitude,
                self.dora_factor,
            )
            for t in d.values()
        ]
        tensors += [t for e in self.embedding.values() for t in (e.a, e.b)]
        tensors += [r.values for r in self.token_rows.values()]
        tensors += [t for p in self.packed.values() for t in p]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())
