"""Check LoRA tensors on the experts of a mixture-of-experts base, as PEFT saves them.

PEFT targets transformers 5's stacked experts (`model.layers.N.mlp.experts.gate_up_proj` `[E, 2*I, H]`,
`.down_proj` `[E, H, I]`) with `target_parameters` and saves per targeted parameter `lora_A.weight`
`[E*r, in]` and `lora_B.weight` `[out, r*E]`. The keys do not name the parameter: two targeted
parameters of one module are nested wrappers, the first registered (gate_up_proj) innermost, so its
keys read `experts.base_layer.lora_A.weight` and the outer one's `experts.lora_A.weight`. The
inference server reads them the same way (services/inference/lora/expert_targets.py).
"""

from __future__ import annotations

import re

from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import LoraConfig
from loraplex.adapter_store.safetensors_header import TensorInfo

WEIGHTS_FILE = "adapter_model.safetensors"
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the experts module's registration order
EXPERT_MODULE_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts(?P<nest>(?:\.base_layer)*)$")


def is_expert_module(module: str) -> bool:
    return EXPERT_MODULE_RE.match(module) is not None


def _targeted(config: LoraConfig, layer: int) -> list[str]:
    """The expert parameters of `layer` that target_parameters reaches (PEFT: equal, or a `.` suffix)."""
    paths = {p: f"model.layers.{layer}.mlp.experts.{p}" for p in EXPERT_PARAMS}
    return [
        p
        for p, path in paths.items()
        if any(path == t or path.endswith(f".{t}") for t in config.target_parameters)
    ]


def check_expert_module(
    module: str, a: TensorInfo, b: TensorInfo, config: LoraConfig, base: BaseModelShapes | None
) -> int:
    """Check one expert parameter's lora_A / lora_B against the config (and the base); its rank."""
    m = EXPERT_MODULE_RE.match(module)
    layer, depth = int(m["layer"]), m["nest"].count(".base_layer")
    targeted = _targeted(config, layer)
    if depth >= len(targeted):
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: expert tensors of layer {layer} that target_parameters "
            f"{list(config.target_parameters)!r} does not target",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    param = targeted[len(targeted) - 1 - depth]  # the innermost wrapper is the first targeted
    rank = config.rank_for(f"model.layers.{layer}.mlp.experts.{param}")
    (a_rows, in_features), (out_features, b_cols) = a.shape, b.shape
    if a_rows != b_cols or a_rows % rank:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: {param} of layer {layer}: lora_A {list(a.shape)} and lora_B "
            f"{list(b.shape)} are not num_experts x rank {rank} (r / rank_pattern) on both sides",
            field=f"{WEIGHTS_FILE}:{a.name}.shape",
        )
    if base is None:
        return rank
    experts = base.experts
    if experts is None or layer >= len(experts.sparse_layers) or not experts.sparse_layers[layer]:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: base model {base.name} has no experts in layer {layer}",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    want_in, want_out = experts.params[param]
    want = (experts.num_experts * rank, want_in, want_out)
    if (a_rows, in_features, out_features) != want:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: {param} of layer {layer}: lora_A {list(a.shape)} / lora_B "
            f"{list(b.shape)}, but base model {base.name}'s {experts.num_experts} experts of rank {rank} "
            "need "
            f"[{want[0]}, {want_in}] / [{want_out}, {want[0]}]",
            field=f"{WEIGHTS_FILE}:{a.name}.shape",
        )
    return rank
