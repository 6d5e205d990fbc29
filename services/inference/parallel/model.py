"""The Llama-family model split over tensor-parallel ranks, and loading one rank's shard.

The model is `models/llama.py` built from the rank's local config (its heads, KV heads and
MLP columns), so q/k/v and gate/up are column-parallel as built; `o_proj` and `down_proj`
become row-parallel (partial matmul, all-reduce, then bias), and the embedding and lm_head
hold a slice of the vocabulary. Mixture-of-experts layers hold every expert's slice of the
intermediate width and all-reduce their output (`RowParallelMoE`). Collectives use the default
process group: the same code runs over gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from loraplex.kernels.fp8_quant import QuantizedRows
from loraplex.services.inference.lora.shapes import FUSED_MODULES
from loraplex.services.inference.models.config import ModelConfig, UnsupportedModelError, load_config
from loraplex.services.inference.models.layers import FusedLinear
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.loader import default_dtype, safetensors_files
from loraplex.services.inference.models.moe import SparseMoE
from loraplex.services.inference.models.quantization.fp8_linear import (
    SCALE_KINDS,
    Fp8Linear,
    load_fp8,
    quantize_linears,
)
from loraplex.services.inference.models.quantization.scheme import read_quantization_config, resolve_scheme
from loraplex.services.inference.parallel.partition import (
    COLUMN_MODULES,
    EXPERT_ROW_PROJECTIONS,
    EXPERT_TENSOR,
    ROW_MODULES,
    ShardPlan,
)

log = logging.getLogger(__name__)


class RowParallelLinear(FusedLinear):
    """Input-split linear: each rank multiplies its input slice; the sum is all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        if self.bias is not None:  # whole on every rank: added once, after the sum
            out += self.bias
        return out


class Fp8RowParallelLinear(Fp8Linear):
    """The FP8 row-parallel linear: each rank's FP8 partial matmul, all-reduced, then the bias."""

    def forward(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        out = self.base_matmul(x, None, xq)
        dist.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out


class RowParallelMoE(SparseMoE):
    """Every expert's slice of the intermediate width: each rank routes every token the same way
    (whole router), runs its slices, and the partial down projections are all-reduced."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = super().forward(x, *args, **kwargs)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, start + rows)` of the (zero-padded) table; other ranks' ids give zeros."""

    def __init__(self, rows: int, hidden: int, start: int):
        super().__init__()
        self.start, self.rows = start, rows
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        dist.all_reduce(out)  # exactly one rank contributes each row: the sum is exact
        return out


class TPLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan):
        local = plan.local_config(cfg)
        super().__init__(local)
        self.config = cfg  # whole vocab: the runner and graphs size logits by it
        self.plan = plan
        for layer in self.layers:
            for attr in ("o_proj", "down_proj"):
                fused: FusedLinear | None = getattr(layer, attr)
                if fused is None:  # a sparse layer's experts: RowParallelMoE below
                    continue
                row = RowParallelLinear(fused.weight.shape[1], fused.out_sizes, fused.bias is not None)
                setattr(layer, attr, row)
            if layer.moe is not None:
                moe = layer.moe  # built from `local`: this rank's expert width
                layer.moe = RowParallelMoE(cfg.hidden_size, local.moe, moe.activation, moe.float_weights)
        self.embed_tokens = VocabParallelEmbedding(plan.vocab_per_rank, cfg.hidden_size, plan.vocab_start)
        if self.lm_head is not None:
            self.lm_head = nn.Parameter(
                torch.empty(plan.vocab_per_rank, cfg.hidden_size), requires_grad=False
            )

    def compute_logits(self, hidden: torch.Tensor, lora: object = None) -> torch.Tensor:
        """All ranks get the whole `[rows, vocab]` float32 logits (every rank sees the same rows).
        `lora` is always None: lm_head LoRA is refused under TP (lora/embedding_lora.py TP_REFUSAL)."""
        assert lora is None, "lm_head LoRA under tensor parallelism"
        if hidden.shape[0] == 0:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        local = super().compute_logits(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.plan.tp_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]


def _shard_scale(sl, module: str, kind: str, plan: ShardPlan, block: tuple[int, int] | None) -> torch.Tensor:
    """This rank's part of an FP8 scale: per-channel scales go with their weight rows, per-tensor
    and input scales whole, block scales by block (the rank's rows or columns must start on one)."""
    shape = sl.get_shape()
    column = module in COLUMN_MODULES
    if kind == "input_scale" or math.prod(shape) == 1 or not (column or module in ROW_MODULES):
        return sl[:]
    a, b = plan.module_range(module)
    if kind == "weight_scale":  # per channel [out, 1]: rows of column modules, whole for row modules
        return sl[a:b] if column else sl[:]
    bn, bk = block
    step = bn if column else bk
    if a % step or (column and b % step):
        raise ValueError(
            f"block-wise FP8 ({bn}x{bk}) under --tp-size {plan.tp_size}: {module}'s shard "
            f"[{a}, {b}) does not fall on {step}-element block boundaries; use a smaller --tp-size"
        )
    if column:
        return sl[a // bn : b // bn]
    return sl[:, a // bk : math.ceil(b / bk)]


def _shard(name: str, f, plan: ShardPlan, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Read only this rank's slice of checkpoint tensor `name`."""
    sl = f.get_slice(name)
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    kind = parts[-1]
    if kind in SCALE_KINDS:
        return _shard_scale(sl, module, kind, plan, block)
    expert = EXPERT_TENSOR.search(name)
    if expert is not None:  # every expert's slice of the intermediate width (partition.py)
        a, b = plan.moe_inter
        return sl[:, a:b] if expert[1] in EXPERT_ROW_PROJECTIONS else sl[a:b]
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        a, b = plan.module_range(module)
        return sl[a:b]  # weight rows or bias entries
    if module in FUSED_MODULES:  # Phi-3's fused tensors: this rank's rows of each part, still fused
        parts, start, rows = FUSED_MODULES[module], 0, []
        for part in parts:
            a, b = plan.module_range(part)
            rows.append(sl[start + a : start + b])
            start += plan.full_width(part)
        return torch.cat(rows)
    if module in ("o_proj", "down_proj") and kind == "weight":
        a, b = plan.module_range(module)
        return sl[:, a:b]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        a, b = plan.vocab
        rows = sl[a:b]
        pad = plan.vocab_per_rank - rows.shape[0]
        return F.pad(rows, (0, 0, 0, pad)) if pad else rows
    return sl[:]


def _iter_shards(
    files: list[Path], plan: ShardPlan, block: tuple[int, int] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, _shard(name, f, plan, block)


def load_tp_model(
    model_dir: Path,
    plan: ShardPlan,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> TPLlamaForCausalLM:
    """Build this rank's model on `device` and copy its slices of the checkpoint into it (FP8
    linears as models/loader.py `load_model` picks them; their scales sharded with the weights)."""
    cfg = load_config(model_dir)
    scheme = resolve_scheme(quantization, read_quantization_config(model_dir))
    with torch.device(device), default_dtype(dtype):
        model = TPLlamaForCausalLM(cfg, plan)
    try:
        if scheme is None:
            model.load_weights(_iter_shards(safetensors_files(model_dir), plan))
        else:
            with torch.device(device), default_dtype(dtype):
                quantize_linears(model, scheme, {RowParallelLinear: Fp8RowParallelLinear})
            load_fp8(model, _iter_shards(safetensors_files(model_dir), plan, scheme.block))
    except ValueError as exc:
        raise UnsupportedModelError(f"{model_dir}: {exc}") from exc
    model.eval()
    log.info(
        "TP rank %d/%d: heads %s, KV heads %s, MLP columns %s, vocab rows %s on %s",
        plan.rank,
        plan.tp_size,
        plan.heads,
        plan.kv_heads,
        plan.inter,
        plan.vocab,
        device,
    )
    return model
