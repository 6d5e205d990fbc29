"""Adapters of Phi-3's fused modules (qkv_proj, gate_up_proj: one A, one B over the fused output):
read into the pool as their parts, validated against the base model's shapes by the inference
side and by the adapter store, and refused where the module does not exist in the base model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from loraplex.adapter_store.base_model import shapes_from_config
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import parse_lora_config
from loraplex.adapter_store.validate import validate_adapter
from loraplex.services.inference.errors import AdapterInvalid
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.settings import parse_target_modules
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from tests.support.factories import make_tiny_model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("phi3-fused"), arch="phi3", vocab_size=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-fused"), vocab_size=256)


def test_fused_adapter_becomes_its_parts(phi3, adapter_factory):
    adapter = adapter_factory(phi3, "phi3-qkv", r=4, target_modules=["qkv_proj", "gate_up_proj"], seed=3)
    shapes = ModelShapes.from_model_dir(phi3)
    assert shapes.fused_checkpoint and shapes.hf_modules == (
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    )
    weights = load_adapter_weights(adapter, shapes)
    assert {m for _, m in weights.targets} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    raw = load_file(adapter / "adapter_model.safetensors")
    a = raw["base_model.model.model.layers.1.self_attn.qkv_proj.lora_A.weight"]
    b = raw["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
    q, kv = shapes.q_size, shapes.kv_size
    for module in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(weights.lora_a[(1, module)], a)  # one A, shared: no rank padding
    assert torch.equal(weights.lora_b[(1, "q_proj")], b[:q])
    assert torch.equal(weights.lora_b[(1, "k_proj")], b[q : q + kv])
    assert torch.equal(weights.lora_b[(1, "v_proj")], b[q + kv :])
    up = raw["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"]
    assert torch.equal(weights.lora_b[(0, "up_proj")], up[shapes.intermediate_size :])
    assert parse_target_modules(["qkv_proj", "o_proj"]) == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_all_linear_means_the_fused_linears_on_phi3(phi3, adapter_factory, tmp_path):
    """A hand-written `"target_modules": "all-linear"` config (PEFT resolves it against the model)."""
    everything = adapter_factory(phi3, "phi3-all", r=4, target_modules="all-linear", seed=6)
    config = json.loads((everything / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (everything / "adapter_model.safetensors").read_bytes()
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": "all-linear"}))
    targets = load_adapter_weights(tmp_path, ModelShapes.from_model_dir(phi3)).targets
    assert {m for _, m in targets} == set(ALL_MODULES)
    # and the store accepts it against the Phi-3 base (it matched no module before)
    base = shapes_from_config("phi3", json.loads((phi3 / "config.json").read_text()))
    store_config = parse_lora_config((tmp_path / "adapter_config.json").read_bytes())
    assert validate_adapter(store_config, tmp_path / "adapter_model.safetensors", base).rank == 4


def test_adapter_of_another_module_tree_is_refused(phi3, llama, adapter_factory):
    unfused = adapter_factory(llama, "llama-q", r=4, target_modules=["q_proj"], seed=1)
    with pytest.raises(AdapterInvalid, match="'q_proj' is not a module of this model.*qkv_proj"):
        load_adapter_weights(unfused, ModelShapes.from_model_dir(phi3))
    fused = adapter_factory(phi3, "phi3-qkv-only", r=4, target_modules=["qkv_proj"], seed=2)
    with pytest.raises(AdapterInvalid, match="'qkv_proj' is not a module of this model"):
        load_adapter_weights(fused, ModelShapes.from_model_dir(llama))


def test_store_validates_fused_adapters_against_the_base(phi3, llama, adapter_factory):
    phi3_base = shapes_from_config("phi3", json.loads((phi3 / "config.json").read_text()))
    llama_base = shapes_from_config("llama", json.loads((llama / "config.json").read_text()))
    fused = adapter_factory(phi3, "phi3-store", r=4, target_modules=["qkv_proj", "gate_up_proj"], seed=4)
    config = parse_lora_config((fused / "adapter_config.json").read_bytes())
    assert validate_adapter(config, fused / "adapter_model.safetensors", phi3_base).rank == 4
    with pytest.raises(InvalidArgument, match="llama has no (qkv|gate_up)_proj"):
        validate_adapter(config, fused / "adapter_model.safetensors", llama_base)
    unfused = adapter_factory(llama, "llama-store", r=4, target_modules=["q_proj"], seed=5)
    config = parse_lora_config((unfused / "adapter_config.json").read_bytes())
    with pytest.raises(InvalidArgument, match="has no q_proj"):
        validate_adapter(config, unfused / "adapter_model.safetensors", phi3_base)
