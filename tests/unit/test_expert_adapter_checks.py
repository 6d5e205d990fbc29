"""Adapters with LoRA on the experts (PEFT target_parameters), checked against the base's experts by
the adapter store (adapter_store/expert_check.py) and by the inference server's loader
(lora/adapter_loader.py, lora/expert_targets.py): the right shapes pass, another base's are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from loraplex.adapter_store.base_model import shapes_from_config
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import parse_lora_config
from loraplex.adapter_store.safetensors_header import SafetensorsHeader, TensorInfo
from loraplex.adapter_store.validate import check_tensors
from loraplex.services.inference.errors import AdapterIncompatible
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.shapes import ModelShapes

E, H, INTER, R = 8, 64, 48, 4
MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    vocab_size=128,
    hidden_size=H,
    intermediate_size=INTER,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=E,
    num_experts_per_tok=2,
)
CONFIG = {
    "peft_type": "LORA",
    "r": R,
    "lora_alpha": 8,
    "target_modules": ["q_proj"],
    "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
    "rank_pattern": {"down_proj": 2},
}


def _tensors(num_experts: int = E, hidden: int = H) -> dict[str, tuple[int, int]]:
    """The keys and shapes PEFT saves for CONFIG (gate_up_proj the inner wrapper)."""
    out = {}
    for n in range(2):
        p = f"base_model.model.model.layers.{n}"
        out[f"{p}.self_attn.q_proj.lora_A.weight"] = (R, hidden)
        out[f"{p}.self_attn.q_proj.lora_B.weight"] = (hidden, R)
        out[f"{p}.mlp.experts.base_layer.lora_A.weight"] = (num_experts * R, hidden)
        out[f"{p}.mlp.experts.base_layer.lora_B.weight"] = (2 * INTER, R * num_experts)
        out[f"{p}.mlp.experts.lora_A.weight"] = (num_experts * 2, INTER)
        out[f"{p}.mlp.experts.lora_B.weight"] = (hidden, 2 * num_experts)
    return out


def _header(shapes: dict[str, tuple[int, int]]) -> SafetensorsHeader:
    infos, at = [], 0
    for name, shape in shapes.items():
        size = shape[0] * shape[1] * 4
        infos.append(TensorInfo(name, "F32", shape, at, at + size))
        at += size
    return SafetensorsHeader(0, at, tuple(infos), {})


def test_store_accepts_expert_adapters_of_the_base_and_refuses_other_shapes():
    config = parse_lora_config(json.dumps(CONFIG).encode())
    base = shapes_from_config("mixtral", MIXTRAL)
    assert base.experts.num_experts == E and base.experts.params["down_proj"] == (INTER, H)
    assert check_tensors(_header(_tensors()), config, base) == ("F32", R)
    # without a base the shapes need only agree with each other and the ranks
    assert check_tensors(_header(_tensors(num_experts=4)), config, None) == ("F32", R)
    with pytest.raises(InvalidArgument, match="mixtral's 8 experts of rank [24] need"):
        check_tensors(_header(_tensors(num_experts=4)), config, base)  # another base's expert count
    wrong_b = {**_tensors(), "base_model.model.model.layers.1.mlp.experts.lora_B.weight": (H + 1, 2 * E)}
    with pytest.raises(InvalidArgument, match="down_proj of layer 1"):
        check_tensors(_header(wrong_b), config, base)
    with pytest.raises(InvalidArgument, match="experts of rank 4 need"):  # r 4 for down_proj too
        check_tensors(
            _header(_tensors()), parse_lora_config(json.dumps({**CONFIG, "rank_pattern": {}}).encode()), base
        )
    attention_only = {**CONFIG, "target_parameters": ["experts.down_proj"]}
    with pytest.raises(InvalidArgument, match="does not target|rank"):
        check_tensors(_header(_tensors()), parse_lora_config(json.dumps(attention_only).encode()), base)
    qwen = shapes_from_config(
        "qwen",
        {
            **MIXTRAL,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": E,
            "moe_intermediate_size": INTER,
            "mlp_only_layers": [1],
        },
    )
    with pytest.raises(InvalidArgument, match="has no experts in layer 1"):
        check_tensors(_header(_tensors()), config, qwen)


def test_server_loads_expert_adapters_per_expert_and_refuses_another_bases(tmp_path):
    gen = torch.Generator().manual_seed(0)
    save_file(
        {k: torch.randn(s, generator=gen) for k, s in _tensors().items()},
        tmp_path / "adapter_model.safetensors",
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    weights = load_adapter_weights(tmp_path, ModelShapes.from_hf_config(MIXTRAL))
    assert weights.expert_a[(1, "experts.gate_up_proj")].shape == (E, R, H)
    assert weights.expert_b[(1, "experts.down_proj")].shape == (E, H, 2)
    assert weights.max_rank == R and len(weights.expert_targets) == 4
    with pytest.raises(AdapterIncompatible, match="4 experts need"):
        load_adapter_weights(tmp_path, ModelShapes.from_hf_config({**MIXTRAL, "num_local_experts": 4}))
