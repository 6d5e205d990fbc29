"""The MoE forward of a step with LoRA on the experts (lora/expert_lora.py computes the deltas).

`SparseMoE.forward(x, expert_lora=LayerExpertLoRA)` hands the whole MLP here: the base experts by
kernels/moe_grouped.py where SparseMoE runs it (the deltas go into its two kernels, `PairDeltas`),
else by SparseMoE's two torch paths, and each LoRA token's routed (token, expert) pairs get their
adapter's expert delta on the gate_up output (before the activation) and on the down output
(before the routing weight), as PEFT's merged `W_e + scaling * B_e @ A_e` gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loraplex.services.inference.lora.shapes import EXPERT_MODULES

if TYPE_CHECKING:
    from loraplex.services.inference.lora.expert_lora import ExpertLoRA
    from loraplex.services.inference.models.moe import SparseMoE

GATE_UP, DOWN = EXPERT_MODULES


class LayerExpertLoRA:
    """Expert LoRA bound to one sparse layer: `SparseMoE.forward(x, expert_lora=this)` runs `moe_forward`."""

    def __init__(self, lora: ExpertLoRA, row: int):
        self.lora, self.row = lora, row

    def moe_forward(
        self, moe: SparseMoE, x: torch.Tensor, dense: bool, grouped: bool = False
    ) -> torch.Tensor:
        """SparseMoE's output with each LoRA token's routed experts adapted: by the grouped kernel where
        SparseMoE runs it (`grouped`), else by its two torch expert paths, `dense` (every expert over
        every token: decode-sized steps) or sorted by expert."""
        weights, experts = moe.route(x)
        k, row = moe.top_k, self.row
        if grouped:
            from loraplex.kernels.moe_grouped import grouped_moe  # Triton: imported where it runs

            deltas = self.lora.direct_deltas(row, experts) or PairDeltas(
                self, self.lora.pairs(experts), x.shape[0] * k, k
            )
            return grouped_moe(x, moe.gate_up, moe.down, weights, experts, moe.activation, lora=deltas)
        plan = self.lora.pairs(experts)
        tok = plan.flat // k
        if dense:
            gate_up = torch.matmul(x, moe.gate_up.transpose(1, 2))  # [E, T, 2*inter]
            gate_up[plan.experts, tok] += self.lora.delta(row, GATE_UP, x[tok], plan, k)
            act = moe._act(gate_up)
            out = torch.matmul(act, moe.down.transpose(1, 2))  # [E, T, hidden]
            out[plan.experts, tok] += self.lora.delta(row, DOWN, act[plan.experts, tok], plan, k)
            combine = torch.zeros(x.shape[0], moe.num_experts, dtype=weights.dtype, device=x.device)
            combine.scatter_(1, experts, weights)
            return (out * combine.t()[:, :, None]).to(x.dtype).sum(dim=0)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        routed = x[tokens]
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=x.device)
        pos = position[plan.flat]  # each LoRA pair's row among the expert-sorted pairs
        gate_up = routed.new_empty(routed.shape[0], 2 * moe.inter)
        bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
        for e in range(moe.num_experts):
            if counts[e]:
                gate_up[bounds[e] : bounds[e + 1]] = F.linear(
                    routed[bounds[e] : bounds[e + 1]], moe.gate_up[e]
                )
        gate_up[pos] += self.lora.delta(row, GATE_UP, x[tok], plan, k)
        act = moe._act(gate_up)
        out = torch.empty_like(routed)
        for e in range(moe.num_experts):
            if counts[e]:
                out[bounds[e] : bounds[e + 1]] = F.linear(act[bounds[e] : bounds[e + 1]], moe.down[e])
        out[pos] += self.lora.delta(row, DOWN, act[pos], plan, k)
        scaled = (out * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, scaled)


class PairDeltas:
    """One layer's expert LoRA as kernels/moe_grouped.py takes it (`ExpertDeltas`): the plan's pair
    deltas scattered to pair order (`token * top_k + slot`), zero for pairs without expert LoRA."""

    def __init__(self, layer: LayerExpertLoRA, plan, pairs: int, top_k: int):
        self.layer, self.plan, self.pairs, self.top_k = layer, plan, pairs, top_k

    def _scatter(self, delta: torch.Tensor) -> torch.Tensor:
        out = delta.new_zeros(self.pairs, delta.shape[1])
        return out.index_copy_(0, self.plan.flat, delta)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        xs = x[self.plan.flat // self.top_k]
        return self._scatter(self.layer.lora.delta(self.layer.row, GATE_UP, xs, self.plan, self.top_k))

    def down(self, act: torch.Tensor) -> torch.Tensor:
        xs = act[self.plan.flat]
        return self._scatter(self.layer.lora.delta(self.layer.row, DOWN, xs, self.plan, self.top_k))
