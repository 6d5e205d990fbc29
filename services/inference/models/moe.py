"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE, in torch (CPU and GPU).

A router linear scores every expert per token; the softmax over all experts (float32), its top k,
renormalised to sum 1 when `norm_topk_prob` (Mixtral always), weight the chosen experts' gated
MLPs. Two ways to run the experts, the same numbers:
- sorted (more than `DENSE_MAX_TOKENS` tokens: prefill): the (token, expert) pairs are sorted by
  expert so each expert runs one matmul over exactly the tokens routed to it; the per-expert counts
  are read on the host (one sync per layer) to slice them.
- dense (up to `DENSE_MAX_TOKENS`: decode batches): every expert over every token in two batched
  matmuls, combined with the routing weights (zero for the experts a token did not pick). A decode
  batch of 64 x top-8 of 128 experts touches nearly every expert anyway, so the step reads the same
  weights with 2 launches instead of 2 per expert, and nothing syncs the host.
- grouped (CUDA): kernels/moe_grouped.py, a Triton grouped GEMM over the pairs sorted by expert on the
  device, for every step size. Nothing syncs the host, so MoE steps of any size capture in CUDA graphs
  (`graph_safe_max_tokens`). Its whole-model decode step measured 27.4 ms against the torch paths'
  33.5 ms (Qwen3-30B-A3B shape, batch 64, H100; docs/benchmarks.md, "Facts behind defaults").
Without the grouped kernel (the CPU) the sorted path's host sync keeps prefill-sized steps out of graphs.

Expert weights are stacked `[E, 2 * inter, hidden]` (gate rows, then up rows) and `[E, hidden,
inter]`; `load_expert` copies one checkpoint tensor (`experts.N.w1` / `gate_proj` ...) into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.services.inference.models.config import MoEConfig

# checkpoint expert projection -> (our stacked parameter, part: 0 gate rows, 1 up rows, -1 whole)
EXPERT_WEIGHTS = {
    "w1": ("gate_up", 0),  # Mixtral
    "w3": ("gate_up", 1),
    "w2": ("down", -1),
    "gate_proj": ("gate_up", 0),  # Qwen3-MoE
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", -1),
}
# Up to this many tokens the experts run dense (see above): E x the FLOPs of the routed tokens, but
# at decode sizes the step is bound by reading the expert weights, which both paths read.
DENSE_MAX_TOKENS = 64
# Tests only: run the grouped kernel on CPU tensors too (Triton's interpreter, TRITON_INTERPRET=1).
MOE_GROUPED_ON_CPU = False
# Benchmarks only (bench/moe.py's control row): the torch paths on CUDA too.
MOE_TORCH_ON_CUDA = False


def grouped_kernel_on(device: torch.device) -> bool:
    """Whether MoE layers on `device` run kernels/moe_grouped.py."""
    return (device.type == "cuda" and not MOE_TORCH_ON_CUDA) or MOE_GROUPED_ON_CPU


def graph_safe_max_tokens(device: torch.device) -> int | None:
    """The largest step whose MoE layers capture in a CUDA graph on `device` (None: any size)."""
    return None if grouped_kernel_on(device) else DENSE_MAX_TOKENS


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, activation: str, float_weights: bool):
        super().__init__()
        self.num_experts, self.top_k, self.inter = moe.num_experts, moe.top_k, moe.intermediate_size
        self.norm_topk_prob = moe.norm_topk_prob
        self.activation = activation
        # Mixtral multiplies each expert's output by its float32 routing weight; Qwen3-MoE first
        # rounds the weights to the model dtype (as transformers does for each).
        self.float_weights = float_weights
        empty = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)  # noqa: E731
        self.gate = empty(self.num_experts, hidden_size)  # the router
        self.gate_up = empty(self.num_experts, 2 * self.inter, hidden_size)
        self.down = empty(self.num_experts, hidden_size, self.inter)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `[T, k]`, expert ids `[T, k]`) for tokens `x` `[T, hidden]`."""
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), experts

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split((self.inter, self.inter), dim=-1)
        return (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def forward(self, x: torch.Tensor, expert_lora=None) -> torch.Tensor:
        if expert_lora is not None:  # LoRA on the experts: its own path (lora/expert_lora.py)
            return expert_lora.moe_forward(
                self, x, dense=x.shape[0] <= DENSE_MAX_TOKENS, grouped=grouped_kernel_on(x.device)
            )
        weights, experts = self.route(x)
        if grouped_kernel_on(x.device):
            return self._grouped(x, weights, experts)
        if x.shape[0] <= DENSE_MAX_TOKENS:
            return self._dense(x, weights, experts)
        return self._sorted(x, weights, experts)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert over every token; `[E, T, hidden]` outputs weighted by the routing (0: not picked)."""
        act = self._act(torch.matmul(x, self.gate_up.transpose(1, 2)))  # [E, T, inter]
        out = torch.matmul(act, self.down.transpose(1, 2))  # [E, T, hidden]
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        combine.scatter_(1, experts, weights)  # [T, E]
        # sum over experts of out[e] * w[t, e], in each family's dtype (as the sorted path rounds)
        scaled = (out * combine.t()[:, :, None]).to(x.dtype)
        return scaled.sum(dim=0)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """kernels/moe_grouped.py: each expert over its routed tokens, sorted on the device."""
        from loraplex.kernels.moe_grouped import grouped_moe  # Triton: imported where it runs

        return grouped_moe(x, self.gate_up, self.down, weights, experts, self.activation)

    def _sorted(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        routed = x[tokens]
        out = torch.empty_like(routed)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            out[rows] = F.linear(self._act(F.linear(routed[rows], self.gate_up[e])), self.down[e])
            start += n
        scaled = (out * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, scaled)

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, name: str) -> str:
        if not 0 <= expert < self.num_experts or proj not in EXPERT_WEIGHTS:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        attr, part = EXPERT_WEIGHTS[proj]
        dest = getattr(self, attr).data[expert]
        if part >= 0:
            dest = dest[part * self.inter : (part + 1) * self.inter]
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(tensor)
        return f"{attr}.{expert}.{part}"
