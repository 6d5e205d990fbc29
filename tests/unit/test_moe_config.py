"""Mixture-of-experts bases: what config.json decides (experts per layer, routing normalisation) and
what is refused by name (shared experts, TP, LoRA on the experts) in the engine and the store."""

from __future__ import annotations

import pytest

from loraplex.adapter_store.base_model import shapes_from_config
from loraplex.services.inference.errors import AdapterInvalid
from loraplex.services.inference.lora.config import parse_adapter_config, resolve_targets
from loraplex.services.inference.lora.expert_targets import resolve_expert_targets
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.models.config import UnsupportedModelError, parse_config
from loraplex.services.inference.parallel.partition import plan_shards

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)
QWEN3_MOE = {**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "moe_intermediate_size": 32}
MIXTRAL = {**COMMON, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
# transformers 5 writes this for an expert adapter (target_modules gate/up/down are converted).
EXPERT_ADAPTER = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj"],
    "target_parameters": ["down_proj", "gate_up_proj"],
}


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = parse_config({**QWEN3_MOE, "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.is_moe and cfg.moe.num_experts == 8 and cfg.moe.intermediate_size == 32
    # (i + 1) % 2 == 0 -> layers 1 and 3; 3 is dense by mlp_only_layers
    assert cfg.moe.sparse_layers == (False, True, False, False)
    assert not cfg.moe.norm_topk_prob  # transformers' Qwen3MoeConfig default
    # transformers 5 saves num_experts as num_local_experts
    assert parse_config({**QWEN3_MOE, "num_local_experts": 4, "norm_topk_prob": True}).moe.num_experts == 4


def test_mixtral_always_renormalises_and_every_layer_is_sparse():
    cfg = parse_config(MIXTRAL)
    assert cfg.moe.norm_topk_prob and cfg.moe.sparse_layers == (True,) * 4
    assert cfg.moe.intermediate_size == 128  # Mixtral's experts have intermediate_size
    assert parse_config({**MIXTRAL, "architectures": None, "model_type": "mixtral"}).is_moe


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ],
)
def test_unservable_moe_configs_are_refused_by_name(extra, words):
    with pytest.raises(UnsupportedModelError, match=words):
        parse_config({**MIXTRAL, **extra})


def test_tensor_parallel_splits_every_expert_by_its_width():
    cfg = parse_config({**QWEN3_MOE, "moe_intermediate_size": 33})
    plans = plan_shards(cfg, 2)
    assert [p.moe_inter for p in plans] == [(0, 17), (17, 33)]
    assert [p.local_config(cfg).moe.intermediate_size for p in plans] == [17, 16]
    experts = cfg.moe.num_experts
    assert all(p.local_config(cfg).moe.num_experts == experts for p in plans)  # every rank: every expert
    assert plans[0].local_config(cfg).intermediate_size == -(-cfg.intermediate_size // 2)  # dense layers
    with pytest.raises(ValueError, match="experts' width 33"):
        plan_shards(cfg, 34)


def test_expert_adapters_resolve_to_every_sparse_layers_experts():
    spec = parse_adapter_config({**EXPERT_ADAPTER, "rank_pattern": {"down_proj": 2}})
    assert spec.target_parameters == ("down_proj", "gate_up_proj")
    shapes = ModelShapes.from_hf_config(MIXTRAL)
    assert (shapes.num_experts, shapes.expert_intermediate_size) == (8, 128)
    targets = resolve_expert_targets(spec, shapes)
    assert len(targets) == 8 and targets[(3, "experts.down_proj")].rank == 2
    assert targets[(0, "experts.gate_up_proj")].rank == 4
    qwen = ModelShapes.from_hf_config({**QWEN3_MOE, "num_experts": 8, "mlp_only_layers": [1]})
    assert qwen.expert_intermediate_size == 32 and qwen.sparse_layers == (True, False, True, True)
    assert {n for n, _ in resolve_expert_targets(spec, qwen)} == {0, 2, 3}
    with pytest.raises(AdapterInvalid, match="target_parameters: 'w1' is not an expert parameter"):
        resolve_expert_targets(parse_adapter_config({**EXPERT_ADAPTER, "target_parameters": ["w1"]}), qwen)
    dense = ModelShapes(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)
    with pytest.raises(AdapterInvalid, match="this base model has no experts"):
        resolve_expert_targets(spec, dense)
    # A per-expert adapter of older transformers (target_modules down_proj): not a module LoRA reaches
    shapes = ModelShapes.from_hf_config(MIXTRAL)
    assert shapes.moe and shapes.hf_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    spec = parse_adapter_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "down_proj"]})
    with pytest.raises(
        AdapterInvalid, match="'down_proj'.*q_proj, k_proj, v_proj, o_proj; on this mixture-of-experts"
    ):
        resolve_targets(spec, shapes.num_layers, shapes.hf_modules)
    attention = parse_adapter_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "o_proj"]})
    assert len(resolve_targets(attention, shapes.num_layers, shapes.hf_modules)) == 8


def test_store_validates_moe_adapters_against_attention_only():
    base = shapes_from_config("qwen3-moe", {**QWEN3_MOE, "num_experts": 8})
    assert base.expected("q_proj") == (64, 64) and base.expected("k_proj") == (64, 32)
    assert base.expected("down_proj") is None and base.expected("gate_proj") is None


def test_lora_settings_cover_attention_only_on_moe_bases():
    import torch

    from loraplex.services.inference.lora.settings import LoRAConfig
    from loraplex.services.inference.lora.setup import resolve_lora_settings

    shapes = ModelShapes.from_hf_config(MIXTRAL)
    cpu = torch.device("cpu")
    settings = resolve_lora_settings(LoRAConfig(max_loras_per_batch=2), shapes, cpu, mem_fraction_static=0.9)
    assert settings.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")  # "all" on this base
    wants_experts = LoRAConfig(max_loras_per_batch=2, lora_target_modules=("q_proj", "down_proj"))
    with pytest.raises(ValueError, match="--lora-target-modules down_proj: this mixture-of-experts base"):
        resolve_lora_settings(wants_experts, shapes, cpu, mem_fraction_static=0.9)


def test_expert_buffers_only_when_named_and_only_on_moe_bases():
    import torch

    from loraplex.services.inference.lora.pool import AdapterPool
    from loraplex.services.inference.lora.pool_layout import pool_nbytes
    from loraplex.services.inference.lora.settings import LoRAConfig
    from loraplex.services.inference.lora.setup import resolve_lora_settings

    shapes = ModelShapes.from_hf_config(MIXTRAL)
    cpu = torch.device("cpu")
    flags = ("q_proj", "experts.gate_up_proj", "experts.down_proj")
    settings = resolve_lora_settings(
        LoRAConfig(max_loras_per_batch=2, lora_target_modules=flags, max_lora_rank=4),
        shapes,
        cpu,
        mem_fraction_static=0.9,
    )
    assert settings.target_modules == flags
    pool = AdapterPool(shapes, slots=2, max_rank=4, target_modules=flags, dtype=torch.float32, device=cpu)
    # 4 layers x 2 slots x 8 experts x rank 4 x ((64 + 256) + (128 + 64)) float32 beside q_proj's
    assert pool.experts.nbytes == 4 * 2 * 8 * 4 * (320 + 192) * 4
    assert pool.nbytes == pool_nbytes(shapes, 2, 4, flags, torch.float32)
    dense = ModelShapes(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)
    with pytest.raises(ValueError, match="experts.gate_up_proj.*this base has no experts"):
        resolve_lora_settings(LoRAConfig(lora_target_modules=flags), dense, cpu, mem_fraction_static=0.9)
