"""LoRA on the experts without a host read (`--expert-lora-mode graphs`): CUDA graphs can capture it.

lora/expert_lora.py's `ExpertLoRA` lists the step's adapter slots on the host in `prepare` (one read
of the token slots), so its steps run eagerly. `GraphExpertLoRA` computes the same deltas from device
tensors only, so a captured decode graph replays it with whatever slots the next step writes into
the graph's buffers:
- `prepare(token_slots)` keeps the tensor (in a graph: the graph's static slot buffer) and reads it
  only in device ops, at run time.
- Per layer every routed (token, expert) pair takes part: a pair of slot `s >= 0` and expert `e`
  belongs to group `s * E + e`; base tokens (slot -1) sort after every group and get a zero delta.
  Group sizes are counted with a scatter-add into a fixed-size tensor (no `bincount`, whose size
  depends on the data).
- One `grouped_mm` shrink and one expand per chunk of slots, over the pool's buffers viewed as
  `[slots * E, ...]` groups, at the pool's max rank: a smaller rank reads the zeros
  `ExpertLoRAPool.upload` writes past it (padding: the price of knowing no rank on the host). A
  chunk after the first starts with one more group, the previous slot's last expert, whose rows
  are every row before the chunk; those rows' outputs are discarded. CUDA's grouped GEMM takes
  fewer than `SPAN_MAX_GROUPS` groups a call, so at 128 experts a chunk holds 7 slots.
- At decode-sized steps on the Triton path (up to `PAIR_KERNEL_MAX_PAIRS` routed pairs) the grouped
  expert kernel takes its deltas from kernels/expert_lora_pairs.py instead: one program per pair
  reads that pair's factors only (`direct_deltas`), where the grouped GEMMs above spend most of a
  decode step on empty groups.
- `scaling` comes from the pool's device table (0 where a slot's adapter leaves the module alone,
  whose factors are zeros too).
Same numbers as `ExpertLoRA` (tests/unit/test_expert_lora_graph.py). The base experts run as
SparseMoE runs them: in the grouped kernel (CUDA's default; the deltas go into its two kernels, no
host read at any step size) or in the torch paths, whose sorted one (steps of more than
DENSE_MAX_TOKENS tokens) reads expert counts on the host, so the engine then captures decode graphs
up to that size only (engine/startup.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from loraplex.kernels.placement import triton_runs_on
from loraplex.services.inference.lora import expert_lora
from loraplex.services.inference.lora.expert_lora import ExpertLoRAPool
from loraplex.services.inference.lora.expert_moe import DOWN, GATE_UP, LayerExpertLoRA
from loraplex.services.inference.lora.shapes import expert_dims

# Up to this many routed pairs a step takes the per-pair kernel (kernels/expert_lora_pairs.py), which
# re-reads a group's factors for every pair of it; above, the groups repeat enough that the grouped
# GEMMs (reading each once) win. Decode graphs (batch <= 256, top-8) stay below.
PAIR_KERNEL_MAX_PAIRS = 2048


class GraphPairPlan(NamedTuple):
    """One layer's routed (token, expert) pairs, every one of them, sorted by group."""

    flat: torch.Tensor  # [T * k] the pair's index in the router's `[T, k]` output, flattened
    experts: torch.Tensor  # [T * k] its expert
    slot: torch.Tensor  # [T * k] its token's slot (-1: a base token, sorted last)
    ends: torch.Tensor  # [slots * E] int32 cumulative end row of each group (grouped_mm's offs)


class KernelPairDeltas:
    """`ExpertDeltas` (kernels/moe_grouped.py) computed per routed pair by one Triton launch a module
    (kernels/expert_lora_pairs.py): no sort, no empty groups, nothing read on the host."""

    def __init__(self, pool: ExpertLoRAPool, token_slots: torch.Tensor, row: int, experts: torch.Tensor):
        self.pool, self.token_slots, self.row, self.experts = pool, token_slots, row, experts

    def _run(self, module: str, x: torch.Tensor, per_pair_input: bool) -> torch.Tensor:
        from loraplex.kernels.expert_lora_pairs import expert_pair_lora  # Triton: imported where it runs

        pool, top_k = self.pool, self.experts.shape[1]
        if module not in pool.a:
            out_width = expert_dims(pool.shapes, module.removeprefix("experts."))[1]
            return x.new_zeros(self.experts.numel(), out_width)
        groups = pool.slots * pool.num_experts
        a = pool.a[module][self.row].view(groups, pool.max_rank, -1)
        b = pool.b[module][self.row].view(groups, -1, pool.max_rank)
        scale = pool.dev_scaling[module][self.row]
        return expert_pair_lora(x, a, b, scale, self.experts, self.token_slots, top_k, per_pair_input)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(GATE_UP, x, per_pair_input=False)

    def down(self, act: torch.Tensor) -> torch.Tensor:
        return self._run(DOWN, act, per_pair_input=True)


class GraphExpertLoRA:
    """Expert LoRA over an `ExpertLoRAPool` from device tensors only (see the module docstring).

    Contract: the `ExpertLoRA` one (`prepare` once a step, `at(layer)` for SparseMoE.forward, the
    same deltas), and `prepare` reads nothing on the host, so every step it serves may be captured."""

    graph_safe = True

    @staticmethod
    def fits(pool: ExpertLoRAPool) -> bool:
        """Whether this mode can serve `pool`: CUDA's grouped GEMM (the long steps' path) takes
        bfloat16 with 16-byte aligned strides, the rank being one of them."""
        factors = next(iter(pool.a.values()))
        return factors.device.type != "cuda" or (pool.max_rank % 8 == 0 and factors.dtype == torch.bfloat16)

    def __init__(self, pool: ExpertLoRAPool):
        factors = next(iter(pool.a.values()))
        if not self.fits(pool):
            raise ValueError(
                "--expert-lora-mode graphs needs bfloat16 and --max-lora-rank a multiple of 8 on CUDA "
                f"(got {factors.dtype}, rank {pool.max_rank})"
            )
        self.pool = pool
        self._slots: torch.Tensor | None = None

    def prepare(self, token_slots: torch.Tensor) -> None:
        self._slots = token_slots

    def at(self, layer: int) -> LayerExpertLoRA | None:
        """The hook SparseMoE.forward takes for `layer`: every step computes it (zero for base tokens)."""
        if self._slots is None or layer not in self.pool.layer_row:
            return None
        return LayerExpertLoRA(self, self.pool.layer_row[layer])

    def direct_deltas(self, row: int, experts: torch.Tensor) -> KernelPairDeltas | None:
        """The grouped expert kernel's deltas straight from each pair's factors
        (kernels/expert_lora_pairs.py) at decode-sized steps on the Triton path; None elsewhere
        (the caller plans the pairs and takes the grouped GEMMs below)."""
        if experts.numel() > PAIR_KERNEL_MAX_PAIRS or not triton_runs_on(experts):
            return None
        return KernelPairDeltas(self.pool, self._slots, row, experts)

    def pairs(self, experts: torch.Tensor) -> GraphPairPlan:
        """Sort one layer's routed pairs `[T, k]` by (slot, expert), base tokens last."""
        t, k = experts.shape
        groups = self.pool.slots * self.pool.num_experts
        slot = self._slots[:t].to(torch.int64).repeat_interleave(k)
        chosen = experts.flatten()
        key = torch.where(slot >= 0, slot * self.pool.num_experts + chosen, groups)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(groups + 1, dtype=torch.int64, device=key.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        ends = counts.cumsum(0)[:groups].to(torch.int32)
        return GraphPairPlan(order, chosen[order], slot[order], ends)

    def delta(self, row: int, module: str, xs: torch.Tensor, plan: GraphPairPlan, top_k: int) -> torch.Tensor:
        """`[P, out]`: each pair's `scaling * B(A x)` for its slot and expert (0 for base tokens)."""
        pool, e = self.pool, self.pool.num_experts
        out_width = expert_dims(pool.shapes, module.removeprefix("experts."))[1]
        out = torch.zeros(xs.shape[0], out_width, dtype=xs.dtype, device=xs.device)
        if module not in pool.a:
            return out
        r = pool.max_rank
        a = pool.a[module][row].reshape(pool.slots * e, r, -1).transpose(1, 2)  # [G, in, R]
        b = pool.b[module][row].reshape(pool.slots * e, -1, r).transpose(1, 2)  # [G, R, out]
        scale = pool.dev_scaling[module][row].to(xs.dtype)[plan.slot.clamp(min=0)][:, None]
        # A slot whose adapter leaves the module alone has scaling 0; its factors may never have
        # been written (the pool is allocated uninitialised), so its rows are dropped, not scaled.
        lora_rows = (plan.slot >= 0) & (scale[:, 0] != 0)
        per_call = max(1, (expert_lora.SPAN_MAX_GROUPS - 2) // e)
        for lo in range(0, pool.slots, per_call):
            hi = min(pool.slots, lo + per_call)
            first = lo * e - (1 if lo else 0)  # a later chunk's first group takes the rows before it
            offs = plan.ends[first : hi * e]
            part = F.grouped_mm(F.grouped_mm(xs, a[first : hi * e], offs=offs), b[first : hi * e], offs=offs)
            # Rows outside the chunk are another chunk's, or past the last offset (unwritten).
            mine = lora_rows & (plan.slot >= lo) & (plan.slot < hi)
            out = torch.where(mine[:, None], part * scale, out)
        return out
