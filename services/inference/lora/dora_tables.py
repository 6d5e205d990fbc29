"""The pool's DoRA tables: per module group, the per-row factor `m / ||W + sBA||` of each slot holding a
DoRA adapter (lora/dora.py computes it once at load), read by `LoRABackend.dora` through the step's
token slots, and a per-slot flag.

`factors[g]`: `[L, slots + 1, sum(w)]` float32, allocated with the first DoRA adapter (servers without
one pay nothing); row `slots` is all ones, the row non-DoRA tokens index. A slot's row is written on
the pool's upload stream; a non-DoRA adapter over a slot clears only its flag.
"""

from __future__ import annotations

import logging

import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.shapes import ModelShapes

log = logging.getLogger(__name__)


class DoraTables:
    def __init__(
        self,
        shapes: ModelShapes,
        groups: tuple[str, ...],
        offsets: dict[str, tuple[int, ...]],
        slots: int,
        device: torch.device,
    ):
        self.shapes, self.groups, self.offsets, self.slots = shapes, groups, offsets, slots
        self.device, self._cuda = device, device.type == "cuda"
        self.host_flag = torch.zeros(slots, dtype=torch.bool)  # for the step's choice of graph variant
        self.flag = torch.zeros(slots, dtype=torch.bool, device=device)  # for the device-side index
        self.factors: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.factors.values())

    def upload(self, slot: int, weights: AdapterWeights, keep: list) -> None:
        """The slot's factors (ones for a module it does not target) and its flag, on the current
        stream; host tensors that must outlive asynchronous copies are appended to `keep`."""
        is_dora = bool(weights.dora_factor)
        if is_dora and not self.factors:
            log.info("DoRA adapter in the pool: allocating its per-row factor tables")
            for g in self.groups:
                width = self.offsets[g][-1]
                t = torch.empty(self.shapes.num_layers, self.slots + 1, width, device=self.device)
                self.factors[g] = t.fill_(1.0)
        if is_dora:
            for g in self.groups:
                factor = torch.ones(self.shapes.num_layers, self.offsets[g][-1])
                for (layer, module), f in weights.dora_factor.items():
                    if module in GROUPS[g]:
                        i = GROUPS[g].index(module)
                        factor[layer, self.offsets[g][i] : self.offsets[g][i + 1]] = f
                if self._cuda:
                    factor = factor.pin_memory()
                    keep.append(factor)
                self.factors[g][:, slot].copy_(factor, non_blocking=True)
        self.host_flag[slot] = is_dora
        flag = torch.tensor([is_dora])
        if self._cuda:
            flag = flag.pin_memory()
            keep.append(flag)
        self.flag[slot : slot + 1].copy_(flag, non_blocking=True)
