"""How weights are split over tensor-parallel ranks (pure functions, no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.lora.shapes import ModelShapes
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
    shard = shard_adapter(weights, plan, ModelShapes.from_model_dir(smollm2_path))
    assert torch.equal(shard.lora_a[(0, "q_proj")], a_q)  # column-parallel: A whole
    assert torch.equal(shard.lora_b[(0, "q_proj")], b_q[384:576])  # B by output rows
    assert torch.equal(shard.lora_a[(0, "o_proj")], a_o[:, 384:576])  # row-parallel: A by input columns
    assert torch.equal(shard.lora_b[(0, "o_proj")], b_o)  # B whole


def test_a_packed_shard_slices_its_packs_as_the_modules_and_pickles_only_them(smollm2_path, adapter_factory):
    # The loader's A/B are views into per-group packs (lora/packed_groups.py), and pickle writes a view's
    # whole storage: a shard sent down a worker's pipe carries its packs only (a few tensors, each
    # written once), sliced exactly as the per-module shards are.
    import pickle

    from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
    from loraplex.services.inference.lora.backend import GROUPS

    shapes = ModelShapes.from_model_dir(smollm2_path)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    adapter = adapter_factory(smollm2_path, "tp-packs", r=8, target_modules=modules)
    weights = load_adapter_weights(adapter, shapes)
    plan = plan_shards(load_config(smollm2_path), 2)[1]
    sent = shard_adapter(weights, plan, shapes)
    per_module = shard_adapter(dataclasses.replace(weights, packed={}), plan, shapes)
    assert set(sent.packed) == {"qkv", "o", "gate_up", "down"} and not sent.lora_a
    pack_bytes = sum(t.numel() * t.element_size() for p in sent.packed.values() for t in p)
    assert len(pickle.dumps(sent)) < 1.1 * pack_bytes
    assert len(pickle.dumps(per_module)) < 1.1 * per_module.nbytes  # its own storages too
    for (layer, module), t in weights.targets.items():
        g = next(g for g, ms in GROUPS.items() if module in ms)
        i = GROUPS[g].index(module)
        local = [hi - lo for lo, hi in map(plan.module_range, GROUPS[g])]  # this rank's rows per module
        lo = 0 if g in ("o", "down") else sum(local[:i])  # a row group's B is whole
        a, b = sent.packed[g].a, sent.packed[g].b
        want_b = per_module.lora_b[(layer, module)]
        assert torch.equal(a[layer, i, : t.rank], per_module.lora_a[(layer, module)])
        assert torch.equal(b[layer, lo : lo + want_b.shape[0], : t.rank], want_b)
