"""The seam between the model and LoRA: a backend applies resident adapters' deltas.

The model calls `begin` before each target linear and `finish` after it (by default `apply`
after it; `finish` may hand the delta back for the model to fuse into its next kernel); the
model runner calls `prepare` once per step. Module groups and the pool layout are fixed here so
kernels, the pool and the model agree (see docs/architecture.md, "LoRA pool layout").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from loraplex.kernels.dora_scale import dora_scale, dora_scale_ref
from loraplex.kernels.placement import triton_runs_on

if TYPE_CHECKING:
    from loraplex.services.inference.lora.expert_lora import ExpertLoRA, LayerExpertLoRA
    from loraplex.services.inference.lora.pool import AdapterPool

# group -> the PEFT module names stacked in it, in output order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRABackend(ABC):
    """Adds `scale_s * (x @ A_s^T) @ B_s^T` to a target linear's output, per token's slot.

    Contract:
    - `prepare(token_slots, max_distinct)` is called once per forward with an int32 device
      tensor of the batch's tokens in forward order (-1 = no adapter) and an upper bound on
      the distinct slots among them (None: unknown, any of the pool's). The eager model runner
      passes the step's own count; a CUDA graph passes its LoRA tier's bound
      (`loraplex.kernels.lora_plan.tier_distinct_bound`), since one graph serves every step of its tier.
      A backend may pick its launches by it (the Triton backend's launch plan). Everything
      per-step (sorting, segments, the launch plan) happens here, never per layer. It must not
      sync the host when the tensor lives in a CUDA graph's static buffer.
    - `apply(layer, group, x, out)` adds the delta in place: `x` is `[T, in]`, `out` is
      `[T, sum(stack widths)]`, the stacked output of that group's fused linear. Tokens
      with slot -1, and slots whose adapter does not target a module, cost nothing.
    - `cuda_graph_safe` is False for a backend whose `prepare` reads the slots on the host;
      the model runner must not capture CUDA graphs around it.
    """

    name: str = ""  # its --lora-backend value
    cuda_graph_safe: bool = True
    pool: AdapterPool  # the slots it reads
    # The most distinct adapters one step can hold: --max-loras-per-batch where it is below the
    # pool's slots (lora/setup.py sets it), else None (the pool's slots). It decides which LoRA tiers
    # the CUDA graphs capture and the warm-up compiles: a tier no step can reach is not captured.
    step_distinct_cap: int | None = None

    # LoRA on the experts of a mixture-of-experts base (lora/expert_lora.py), when the pool holds
    # expert buffers; `prepare` must call its `prepare` too.
    experts: ExpertLoRA | None = None

    # A step holding a DoRA adapter's tokens or one with vocabulary parts (embedding / lm_head LoRA,
    # trainable tokens): the model runner sets it (from the host slot list: `step_has_kinds`) before
    # `prepare` and clears it after the step's logits; a decode graph's kinds variant is captured with
    # it set (engine/cuda_graph.py). Steps without such adapters neither capture nor run those parts.
    kinds_step: bool = False
    _dora_index: torch.Tensor | None = None
    _token_vslots: torch.Tensor | None = None  # each token's vocab slot (lora/vocab_tables.py)
    # The token index of each logits row of an eager step (None: one row per token, as in a graph)
    logit_rows: torch.Tensor | None = None

    @property
    def dora_step(self) -> bool:
        """Whether this step applies the DoRA factors (a kinds step, once the pool holds DoRA tables)."""
        return self.kinds_step and bool(self.pool.dora.factors)

    def step_has_kinds(self, token_slots: list[int]) -> bool:
        """Whether any of the step's slots (host ints, -1 = none) holds a DoRA adapter or one with
        vocabulary parts (`AdapterPool.kinds_slots`); one set test when the pool holds none."""
        pool = getattr(self, "pool", None)  # a backend with no pool (a test's recorder) has none
        kinds = frozenset() if pool is None else pool.kinds_slots
        return bool(kinds) and not kinds.isdisjoint(token_slots)

    def prepare_kinds(self, token_slots: torch.Tensor) -> None:
        """Each token's row of the pool's DoRA tables (its slot where that slot is DoRA, else the row
        of ones) and its vocab slot. Device ops only. Backends call it from `prepare` on a kinds step."""
        slots = token_slots.to(torch.int64)
        if self.pool.dora.factors:
            is_dora = (slots >= 0) & self.pool.dora.flag[slots.clamp(min=0)]
            self._dora_index = torch.where(is_dora, slots, self.pool.slots)
        self._token_vslots = self.pool.vocab.token_vslots(slots)

    def add_embedding(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The looked-up embeddings plus the step's adapters' embedding parts (lora/vocab_tables.py)."""
        if not self.kinds_step:
            return h
        return self.pool.vocab.embed(h, input_ids, self._token_vslots[: h.shape[0]])

    def add_head(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The logits rows plus the step's adapters' lm_head parts (lora/vocab_tables.py)."""
        if not self.kinds_step:
            return logits
        vslots = self._token_vslots
        vslots = vslots[: logits.shape[0]] if self.logit_rows is None else vslots[self.logit_rows]
        return self.pool.vocab.head(logits, hidden, vslots)

    def dora(
        self,
        layer: int,
        group: str,
        out: torch.Tensor,
        delta: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The group's output with DoRA applied: `f * (W x + delta) + b` per token's row, where `out`
        is `W x + b` (plus the delta, when `delta` is None: added in place) and `f` the token's
        factors (ones for tokens of other adapters or none). PEFT adds the bias after the scale."""
        table = self.pool.dora.factors.get(group)
        if table is None:  # a group outside --lora-target-modules: no adapter targets it
            return out if delta is None else out.add_(delta)
        scale = dora_scale if triton_runs_on(out) else dora_scale_ref  # kernels/dora_scale.py
        return scale(out, delta, bias, table[layer], self._dora_index)

    def targets(self, group: str) -> bool:
        """Whether any adapter this backend serves can target `group` (the pool holds its buffers).
        A group no adapter targets takes the model's plain path, e.g. the MLP's one-launch skinny
        gate_up beside q/k/v/o-only adapters."""
        pool = getattr(self, "pool", None)  # a backend with no pool (a test's recorder) may target any
        return pool is None or group in pool.groups

    def max_step_distinct(self) -> int:
        """The most distinct adapters one step can hold (see `step_distinct_cap`)."""
        cap = self.step_distinct_cap
        return self.pool.slots if cap is None else min(cap, self.pool.slots)

    def expert_layer(self, layer: int) -> LayerExpertLoRA | None:
        """The expert-LoRA hook for SparseMoE.forward of `layer` (None: no expert LoRA this step)."""
        return None if self.experts is None else self.experts.at(layer)

    @abstractmethod
    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None: ...

    @abstractmethod
    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def begin(self, layer: int, group: str, x: torch.Tensor) -> object:
        """Start the group's LoRA work before its base matmul is issued; returns a token for `finish`.

        The model calls `begin`, then the base matmul, then `finish` with the matmul's output, so a
        backend may compute the delta beside the matmul (e.g. on a second CUDA stream). It must not
        change `x`. Default: nothing starts early and `finish` runs `apply`.
        """
        return None

    def finish(
        self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, started: object
    ) -> torch.Tensor | None:
        """Complete the group's delta, given `begin`'s token: add it to `out` in place (what `apply`
        does) and return None, or return it as a float32 `[T, width]` tensor that the caller adds
        (`dtype(float(out) + delta)`) before anything reads `out` and before the next `begin`."""
        self.apply(layer, group, x, out)
        return None
