"""LoRA on the experts of a mixture-of-experts base, as PEFT saves it: names, targets and shapes.

transformers 5 stacks each sparse layer's experts into two parameters of `model.layers.N.mlp.experts`:
`gate_up_proj` `[E, 2*I, H]` (gate rows, then up rows) and `down_proj` `[E, H, I]`. PEFT targets them
with `target_parameters` (a `ParamWrapper` per parameter; peft/tuners/lora/layer.py) and saves, per
targeted parameter of output width `out` and input width `in` (the parameter's last two dims, swapped):
- `lora_A.weight` `[E*r, in]`: expert e's A is rows `[e*r, (e+1)*r)` (`A.reshape(E, r, in)[e]`);
- `lora_B.weight` `[out, r*E]`: expert e's B is `B.reshape(out, r, E)[:, :, e]` (rank-major columns);
- the delta of expert e is `scaling * B_e @ A_e`, `scaling` from r / lora_alpha as for any module.
Neither key names the parameter: two targeted parameters of one module are nested wrappers, the one
registered first (gate_up_proj) innermost, so its keys read `experts.base_layer.lora_A.weight` and the
outer one's `experts.lora_A.weight`. Each (layer, parameter) gets PEFT's rank and alpha from
rank_pattern / alpha_pattern matched on `model.layers.N.mlp.experts.<param>`.

Targets are keyed `(layer, "experts.gate_up_proj")`, the names `--lora-target-modules` uses.
"""

from __future__ import annotations

import re

import torch

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA, pattern_value
from loraplex.services.inference.lora.shapes import (
    EXPERT_PARAMS,
    ModelShapes,
    expert_dims,
    sparse_layer_indices,
)
from loraplex.services.inference.lora.tensor_checks import read_checked

WEIGHTS_FILE = "adapter_model.safetensors"
EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<nest>(?:base_layer\.)*)"
    r"lora_(?P<ab>[AB])\.weight$"
)


def module_name(param: str) -> str:
    """`gate_up_proj` -> `experts.gate_up_proj` (the target's name in pools, flags and listings)."""
    return f"experts.{param}"


def param_of(module: str) -> str:
    return module.removeprefix("experts.")


def param_path(layer: int, param: str) -> str:
    """The parameter's name in the HF model, as PEFT matches target_parameters and patterns on it."""
    return f"model.layers.{layer}.mlp.experts.{param}"


def resolve_expert_targets(spec: AdapterSpec, shapes: ModelShapes) -> dict[tuple[int, str], ModuleLoRA]:
    """Which (layer, expert parameter) the adapter's target_parameters reach, with PEFT's rank/alpha.

    PEFT's matching (`_inject_parameters`): a parameter path is targeted when it equals an entry or
    ends with `.entry`. Every entry must reach an expert parameter of this base (AdapterInvalid)."""
    if not spec.target_parameters:
        return {}
    layers = sparse_layer_indices(shapes) if shapes.moe else []
    if not layers:
        raise AdapterInvalid(
            "adapter_config.json: target_parameters: this base model has no experts; LoRA on raw "
            "parameters is served for the experts of mixture-of-experts bases only",
            field="target_parameters",
        )
    paths = {param_path(n, p): (n, p) for n in layers for p in EXPERT_PARAMS}
    out: dict[tuple[int, str], ModuleLoRA] = {}
    for entry in spec.target_parameters:
        hits = [k for k in paths if k == entry or k.endswith(f".{entry}")]
        if not hits:
            raise AdapterInvalid(
                f"adapter_config.json: target_parameters: {entry!r} is not an expert parameter of this "
                "base (LoRA on parameters can target mlp.experts.gate_up_proj, mlp.experts.down_proj)",
                field="target_parameters",
            )
        for key in hits:
            rank = pattern_value(spec.rank_pattern, key, spec.r)
            alpha = float(pattern_value(spec.alpha_pattern, key, spec.lora_alpha))
            layer, param = paths[key]
            out[(layer, module_name(param))] = ModuleLoRA(rank, alpha, spec.scaling(rank, alpha))
    return out


def tensor_keys(targets: dict[tuple[int, str], ModuleLoRA]) -> dict[str, tuple[int, str, str]]:
    """Safetensors key -> (layer, expert module, "A" | "B") for every tensor the targets need."""
    by_layer: dict[int, list[str]] = {}
    for layer, module in targets:
        by_layer.setdefault(layer, []).append(param_of(module))
    keys: dict[str, tuple[int, str, str]] = {}
    for layer, params in by_layer.items():
        nested = [p for p in EXPERT_PARAMS if p in params]  # registration order: innermost first
        for i, param in enumerate(nested):
            prefix = "base_layer." * (len(nested) - 1 - i)
            for ab in "AB":
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{prefix}lora_{ab}.weight"
                keys[key] = (layer, module_name(param), ab)
    return keys


def saved_shape(shapes: ModelShapes, module: str, rank: int, ab: str) -> tuple[int, int]:
    """The shape PEFT saves: A `[E*r, in]`, B `[out, r*E]`."""
    d_in, d_out = expert_dims(shapes, param_of(module))
    e = shapes.num_experts
    return (e * rank, d_in) if ab == "A" else (d_out, rank * e)


def per_expert(t: torch.Tensor, ab: str, num_experts: int, rank: int) -> torch.Tensor:
    """PEFT's saved tensor as per-expert factors: A `[E, r, in]`, B `[E, out, r]` (contiguous)."""
    if ab == "A":
        return t.reshape(num_experts, rank, t.shape[-1]).contiguous()
    return t.reshape(t.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()


def read_expert_tensor(f, key: str, expected: dict, targets: dict, shapes: ModelShapes) -> torch.Tensor:
    """One saved expert LoRA tensor from the open safetensors `f`, its name and shape checked, as per-expert
    factors: A `[E, r, in]`, B `[E, out, r]`."""
    if key not in expected:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: tensor {key!r} is for an expert parameter that adapter_config.json "
            "target_parameters does not target",
            field=WEIGHTS_FILE,
        )
    layer, module, ab = expected[key]
    rank = targets[(layer, module)].rank
    shape = tuple(f.get_slice(key).get_shape())
    want = saved_shape(shapes, module, rank, ab)
    if len(shape) != 2:
        raise AdapterInvalid(f"{WEIGHTS_FILE}: {key!r} has shape {shape}, expected 2-D", field=WEIGHTS_FILE)
    if shape != want:  # rows E*r: a wrong expert count and a wrong rank look alike
        raise AdapterIncompatible(
            f"{WEIGHTS_FILE}: {key!r} ({module}) has shape {shape}, this base model's "
            f"{shapes.num_experts} experts need {want} at rank {rank} (adapter_config.json r / "
            "rank_pattern): the adapter was trained for another base model, or its config disagrees",
            field=WEIGHTS_FILE,
        )
    return per_expert(read_checked(f, key), ab, shapes.num_experts, rank)
