"""How weights are split over tensor-parallel ranks (pure functions, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.models.config import load_config
from loraplex.services.inference.parallel.lora import shard_adapter
from loraplex.services.inference.parallel.partition import plan_shards, split_sizes


def test_split_sizes_uneven():
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(1536, 2) == [768, 768]
    assert sum(split_sizes(11, 4)) == 11


def test_smollm2_heads_split_by_kv_group(smollm2_path):
    cfg = load_config(smollm2_path)  # 9 heads, 3 KV heads, head_dim 64
    p0, p1 = plan_shards(cfg, 2)
    assert (p0.heads, p0.kv_heads, p1.heads, p1.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert p0.local_config(cfg).num_heads // p0.local_config(cfg).num_kv_heads == 3
    assert (p0.inter, p1.inter) == ((0, 768), (768, 1536))
    assert p1.module_range("k_proj") == (128, 192)
    assert p1.module_range("o_proj") == (384, 576)


def test_fewer_kv_heads_than_ranks(smollm2_path):
    cfg = dataclasses.replace(load_config(smollm2_path), num_heads=4, num_kv_heads=1, vocab_size=49153)
    plans = plan_shards(cfg, 2)
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1)]  # replicated
    assert [p.heads for p in plans] == [(0, 2), (2, 4)]
    assert plans[1].vocab == (24577, 49153) and plans[1].vocab_per_rank == 24577  # padded by one row
    with pytest.raises(ValueError, match="multiple of 1 and at most 4"):
        plan_shards(cfg, 8)
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        plan_shards(cfg, 0)
    cfg2 = dataclasses.replace(cfg, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of 2"):
        plan_shards(cfg2, 3)


def test_adapter_shards_follow_s_lora(smollm2_path):
    cfg = load_config(smollm2_path)
    plan = plan_shards(cfg, 2)[1]
    a_q, b_q = torch.randn(4, 576), torch.randn(576, 4)
    a_o, b_o = torch.randn(4, 576), torch.randn(576, 4)
    weights = AdapterWeights(
        AdapterSpec(r=4, lora_alpha=8),
        {(0, "q_proj"): ModuleLoRA(4, 8, 2.0), (0, "o_proj"): ModuleLoRA(4, 8, 2.0)},
        {(0, "q_proj"): a_q, (0, "o_proj"): a_o},
        {(0, "q_proj"): b_q, (0, "o_proj"): b_o},
        "d",
    )
    shard = shard_adapter(weights, plan)
    assert torch.equal(shard.lora_a[(0, "q_proj")], a_q)  # column-parallel: A whole
    assert torch.equal(shard.lora_b[(0, "q_proj")], b_q[384:576])  # B by output rows
    assert torch.equal(shard.lora_a[(0, "o_proj")], a_o[:, 384:576])  # row-parallel: A by input columns
    assert torch.equal(shard.lora_b[(0, "o_proj")], b_o)  # B whole


def test_a_shard_for_a_worker_pickles_only_its_own_tensors(smollm2_path, adapter_factory):
    # The loader's A/B are views into per-group packs (lora/packed_groups.py); pickle writes a view's
    # whole storage, so a shard sent down a worker's pipe must hold its own tensors, or each of its
    # views would carry its group's whole pack (30 layers x q/k/v/o here: 120 copies).
    import pickle

    from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
    from loraplex.services.inference.lora.shapes import ModelShapes

    adapter = adapter_factory(
        smollm2_path, "tp-pickle", r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    weights = load_adapter_weights(adapter, ModelShapes.from_model_dir(smollm2_path))
    assert weights.packed
    plan = plan_shards(load_config(smollm2_path), 2)[1]
    sent = shard_adapter(weights, plan, own_storage=True)
    local = shard_adapter(weights, plan)
    tensor_bytes = sum(t.numel() * t.element_size() for d in (sent.lora_a, sent.lora_b) for t in d.values())
    assert len(pickle.dumps(sent)) < 1.1 * tensor_bytes
    assert not sent.packed and not local.packed  # a shard uploads per (layer, module)
    for key in weights.lora_a:  # the same values either way
        assert torch.equal(sent.lora_a[key], local.lora_a[key])
        assert torch.equal(sent.lora_b[key], local.lora_b[key])
