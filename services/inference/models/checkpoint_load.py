"""Checkpoint tensors into the decoder's parameters (models/llama.py): transformers' names mapped to our
fused linears (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`; Phi-3's fused tensors split by
rows), the norms, the experts and routers of a mixture-of-experts layer, the embedding and lm_head.
A tensor no parameter takes, and a parameter no tensor fills, are errors."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from loraplex.services.inference.models.layers import FusedLinear
from loraplex.services.inference.models.value_checks import check_finite

if TYPE_CHECKING:
    from loraplex.services.inference.models.llama import LlamaForCausalLM


# checkpoint name -> (our module attribute, stack index; -1: the whole fused tensor) for the fused linears.
LAYER_WEIGHTS = {
    "self_attn.qkv_proj": ("qkv_proj", -1),  # Phi-3 stores them fused
    "mlp.gate_up_proj": ("gate_up_proj", -1),
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "self_attn.o_proj": ("o_proj", 0),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", 0),
}
# a projection's PEFT name ("q_proj", "qkv_proj") -> its entry above (checkpoint names end in it)
PROJECTIONS = {name.rsplit(".", 1)[1]: target for name, target in LAYER_WEIGHTS.items()}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Mixtral `block_sparse_moe.experts.N.w1`, Qwen3-MoE `mlp.experts.N.gate_proj`; routers `.gate`.
_EXPERT_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)$")
_ROUTERS = ("block_sparse_moe.gate", "mlp.gate")
_LAYER_NORMS = {
    "input_layernorm",
    "post_attention_layernorm",
    "attn_output_norm",
    "mlp_output_norm",
    "self_attn.q_norm",
    "self_attn.k_norm",
}


def load_checkpoint(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into our (fused) parameters; refuse gaps and strangers."""
    expected = {name for name, _ in model.named_parameters() if ".moe." not in name}
    for i, layer in enumerate(model.layers):  # each expert's three projections, and the router
        if layer.moe is not None:
            expected.add(f"layers.{i}.moe.gate")
            for e in range(layer.moe.num_experts):
                expected |= {f"layers.{i}.moe.{part}.{e}.{p}" for part, p in (("gate_up", 0), ("gate_up", 1))}
                expected.add(f"layers.{i}.moe.down.{e}.-1")
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: some checkpoints still ship the copy
        target = _load_one(model, name, tensor)
        loaded.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")


def _load_one(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> str:
    match = _LAYER_RE.match(name)
    if match:
        layer_idx, module_name, kind = int(match[1]), match[2], match[3]
        module_name = model.config.family.checkpoint_renames.get(module_name, module_name)
        layer = model.layers[layer_idx]
        if layer.moe is not None and kind == "weight":
            expert = _EXPERT_RE.match(module_name)
            if expert:
                part = layer.moe.load_expert(int(expert[1]), expert[2], tensor, name)
                return f"layers.{layer_idx}.moe.{part}"
            if module_name in _ROUTERS:
                check_finite(name, tensor)
                _copy(layer.moe.gate, tensor, name)
                return f"layers.{layer_idx}.moe.gate"
        if module_name in LAYER_WEIGHTS and getattr(layer, LAYER_WEIGHTS[module_name][0]) is not None:
            attr, index = LAYER_WEIGHTS[module_name]
            fused: FusedLinear = getattr(layer, attr)
            if index < 0:  # a fused checkpoint tensor: our stacks in the same order
                if tensor.shape[0] != sum(fused.out_sizes):
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(fused.out_sizes)}")
                for i, part in enumerate(tensor.split(fused.out_sizes, dim=0)):
                    fused.load_shard(i, kind, part)
            else:
                fused.load_shard(index, kind, tensor)
            return f"layers.{layer_idx}.{attr}.{kind}"
        attr = module_name.removeprefix("self_attn.")
        if module_name in _LAYER_NORMS and kind == "weight" and getattr(layer, attr) is not None:
            _copy(getattr(layer, attr).weight, tensor, name)
            return f"layers.{layer_idx}.{attr}.weight"
    simple = {
        "model.embed_tokens.weight": ("embed_tokens.weight", model.embed_tokens.weight),
        "model.norm.weight": ("norm.weight", model.norm.weight),
    }
    if model.lm_head is not None:
        simple["lm_head.weight"] = ("lm_head", model.lm_head)
    if name in simple:
        target_name, param = simple[name]
        _copy(param, tensor, name)
        return target_name
    raise ValueError(f"unexpected tensor {name!r} in checkpoint")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(tensor)
