"""Which slice of every weight each tensor-parallel rank holds.

Attention is split by KV-head group: a rank owns whole groups (its query heads are the
groups' heads), so its local attention is ordinary GQA. Counts that do not divide the rank
count are split unevenly (SmolLM2's 3 KV heads over 2 ranks: 2 + 1), which keeps
`--tp-size 2` exact for any model at the price of some imbalance. With fewer KV heads than
ranks each KV head is replicated on `tp / kv_heads` ranks that split its query heads.
The MLP's intermediate width is split unevenly too; the vocabulary is padded to a multiple
of the rank count (padding rows are zero and cut from the gathered logits).
Mixture-of-experts layers split every expert the same way, by its intermediate width: each rank
holds every expert's slice of gate/up rows and down columns (`moe_inter`), routes every token
itself (the router is whole on each rank) and all-reduces after the down projection, as the dense
MLP does. Every rank then reads 1/tp of each expert a step touches: balanced whatever the routing.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.models.config import ModelConfig

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output split
ROW_MODULES = ("o_proj", "down_proj")  # input split
# An expert's projection in a checkpoint: Mixtral `...experts.N.w1/w3` (column), `w2` (row);
# Qwen3-MoE `...experts.N.gate_proj/up_proj` (column), `down_proj` (row).
EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_ROW_PROJECTIONS = ("w2", "down_proj")


def split_sizes(n: int, parts: int) -> list[int]:
    """`n` items over `parts` as evenly as possible, the larger parts first."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share: half-open ranges of heads, KV heads, intermediate columns, vocab rows."""

    rank: int
    tp_size: int
    head_dim: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]  # rows of the real vocabulary this rank holds
    vocab_per_rank: int  # rows of its (zero-padded) embedding / lm_head shard
    total_heads: int = 0  # the whole model's query heads, KV heads, MLP width (fused tensors' offsets)
    total_kv_heads: int = 0
    total_inter: int = 0
    moe_inter: tuple[int, int] = (0, 0)  # every expert's intermediate columns on this rank (MoE models)

    def full_width(self, module: str) -> int:
        """Output rows of a column module in the whole model."""
        if module == "q_proj":
            return self.total_heads * self.head_dim
        if module in ("k_proj", "v_proj"):
            return self.total_kv_heads * self.head_dim
        return self.total_inter

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config this rank's model and KV cache are built from (vocab stays whole)."""
        moe = cfg.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=self.moe_inter[1] - self.moe_inter[0])
        return dataclasses.replace(
            cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.inter[1] - self.inter[0],
            moe=moe,
        )

    def local_shapes(self, shapes: ModelShapes) -> ModelShapes:
        """LoRA pool shapes: column groups' outputs and row groups' inputs are this rank's slice."""
        return dataclasses.replace(
            shapes,
            intermediate_size=self.inter[1] - self.inter[0],
            q_size=self.num_heads * self.head_dim,
            kv_size=self.num_kv_heads * self.head_dim,
        )

    def module_range(self, module: str) -> tuple[int, int]:
        """The rows (column modules) or input columns (row modules) of a projection on this rank."""
        d = self.head_dim
        if module in ("q_proj", "o_proj"):
            return self.heads[0] * d, self.heads[1] * d
        if module in ("k_proj", "v_proj"):
            return self.kv_heads[0] * d, self.kv_heads[1] * d
        if module in ("gate_proj", "up_proj", "down_proj"):
            return self.inter
        raise KeyError(module)


def plan_shards(cfg: ModelConfig, tp_size: int) -> list[ShardPlan]:
    """Every rank's plan, or ValueError saying why this model cannot run at `tp_size`."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1 (got {tp_size})")
    moe_ranges = [(0, 0)] * tp_size
    if cfg.moe is not None:
        if cfg.moe.intermediate_size < tp_size:
            raise ValueError(f"--tp-size {tp_size} exceeds the experts' width {cfg.moe.intermediate_size}")
        moe_ranges = _ranges(split_sizes(cfg.moe.intermediate_size, tp_size))
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    group = heads // kv
    if kv >= tp_size:
        kv_ranges = _ranges(split_sizes(kv, tp_size))
        head_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        per_kv = tp_size // kv
        if tp_size % kv or group < per_kv:
            raise ValueError(
                f"--tp-size {tp_size}: the model has {heads} attention heads in {kv} KV groups; with fewer "
                f"KV heads than ranks, --tp-size must be a multiple of {kv} and at most {heads} (each rank "
                "needs a query head of one KV group)"
            )
        kv_ranges, head_ranges = [], []
        for k in range(kv):
            for a, b in _ranges(split_sizes(group, per_kv)):
                kv_ranges.append((k, k + 1))
                head_ranges.append((k * group + a, k * group + b))
    if cfg.intermediate_size < tp_size:
        raise ValueError(f"--tp-size {tp_size} exceeds the MLP width {cfg.intermediate_size}")
    inter_ranges = _ranges(split_sizes(cfg.intermediate_size, tp_size))
    per_rank = -(-cfg.vocab_size // tp_size)
    return [
        ShardPlan(
            rank=r,
            tp_size=tp_size,
            head_dim=cfg.head_dim,
            heads=head_ranges[r],
            kv_heads=kv_ranges[r],
            inter=inter_ranges[r],
            vocab=(min(r * per_rank, cfg.vocab_size), min((r + 1) * per_rank, cfg.vocab_size)),
            vocab_per_rank=per_rank,
            total_heads=heads,
            total_kv_heads=kv,
            total_inter=cfg.intermediate_size,
            moe_inter=moe_ranges[r],
        )
        for r in range(tp_size)
    ]
