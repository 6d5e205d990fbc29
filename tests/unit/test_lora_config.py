"""PEFT adapter parsing and validation: what is accepted, what is refused, and with which error."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid, AdapterNotFound
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.config import (
    check_fits,
    parse_adapter_config,
    resolve_embedding_targets,
    resolve_targets,
)
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def base_adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path, "cfg-base", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


BASE_CFG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"bias": "all"}, "bias"),
        ({"use_dora": "yes"}, "use_dora"),
        ({"use_dora": True, "target_parameters": ["experts.down_proj"]}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 0}, "r"),
        ({"r": 4.5}, "r"),
        ({"lora_alpha": -1}, "lora_alpha"),
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"lora_alpha": 1e308}, "lora_alpha"),  # finite, but not as a float32 scaling
        ({"lora_alpha": 1e30}, "lora_alpha"),  # a float32 scaling, but every delta Inf (issue 59)
        ({"alpha_pattern": {"q_proj": 65505}}, "alpha_pattern['q_proj']"),  # past float16's range
        ({"alpha_pattern": {"q_proj": 1e300}}, "alpha_pattern['q_proj']"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj']"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj']"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": "q_proj("}, "target_modules"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_parse_refusals_name_the_field(change, field):
    with pytest.raises(AdapterInvalid) as e:
        parse_adapter_config({**BASE_CFG, **change})
    assert e.value.field == field
    assert field.split("[")[0] in e.value.message


@pytest.mark.parametrize(
    "targets, why",
    [
        (["q_proj", "wq"], "'wq'"),
        (["mlp"], "not one of the linear projections"),
        ("nothing_here", "matches no module"),
    ],
)
def test_target_refusals(targets, why):
    spec = parse_adapter_config({**BASE_CFG, "target_modules": targets})
    with pytest.raises(AdapterInvalid) as e:
        resolve_targets(spec, num_layers=2)
    assert e.value.field == "target_modules" and why in e.value.message


def test_embedding_and_lm_head_targets_resolve_apart_from_the_linears():
    spec = parse_adapter_config(
        {**BASE_CFG, "target_modules": ["embed_tokens", "lm_head", "q_proj"], "rank_pattern": {"lm_head": 2}}
    )
    assert set(resolve_targets(spec, num_layers=2)) == {(0, "q_proj"), (1, "q_proj")}
    got = resolve_embedding_targets(spec, num_layers=2)
    assert got == {"model.embed_tokens": (8, 16.0, 2.0), "lm_head": (2, 16.0, 8.0)}
    only = parse_adapter_config({**BASE_CFG, "target_modules": ".*embed_tokens"})
    assert resolve_targets(only, num_layers=2) == {}
    assert list(resolve_embedding_targets(only, num_layers=2)) == ["model.embed_tokens"]
    # PEFT's all-linear leaves the output layer out
    assert (
        resolve_embedding_targets(parse_adapter_config({**BASE_CFG, "target_modules": "all-linear"}), 2) == {}
    )


def test_targets_list_regex_patterns_match_peft_semantics():
    spec = parse_adapter_config(
        {
            **BASE_CFG,
            "target_modules": r"model\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.down_proj)",
            "rank_pattern": {"k_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
            "alpha_pattern": {"down_proj": 3},
        }
    )
    t = resolve_targets(spec, num_layers=2)
    assert set(t) == {(1, "q_proj"), (1, "k_proj"), (1, "down_proj")}
    assert t[(1, "q_proj")] == (8, 16.0, 2.0)
    assert t[(1, "k_proj")] == (2, 16.0, 8.0)
    assert t[(1, "down_proj")] == (6, 3.0, 0.5)

    rs = parse_adapter_config(
        {**BASE_CFG, "target_modules": "all-linear", "use_rslora": True, "layers_to_transform": [0]}
    )
    t = resolve_targets(rs, num_layers=3)
    assert set(t) == {(0, m) for m in ALL_MODULES}
    assert t[(0, "up_proj")].scaling == pytest.approx(16 / math.sqrt(8))

    ex = parse_adapter_config(
        {
            **BASE_CFG,
            "target_modules": ["q_proj", "self_attn.v_proj"],
            "exclude_modules": ["layers.0.self_attn.q_proj"],
        }
    )
    assert set(resolve_targets(ex, num_layers=2)) == {(1, "q_proj"), (0, "v_proj"), (1, "v_proj")}


def test_check_fits_is_failed_precondition():
    targets = resolve_targets(parse_adapter_config({**BASE_CFG, "target_modules": ["q_proj", "up_proj"]}), 2)
    check_fits(targets, 8, ALL_MODULES)
    with pytest.raises(AdapterIncompatible) as e:
        check_fits(targets, 4, ALL_MODULES)
    assert e.value.field == "r" and "--max-lora-rank" in e.value.message
    with pytest.raises(AdapterIncompatible) as e:
        check_fits(targets, 8, ["q_proj", "v_proj"])
    assert e.value.field == "target_modules" and "up_proj" in e.value.message


def test_load_weights_matches_peft_files(base_adapter, shapes):
    w = load_adapter_weights(base_adapter, shapes)
    raw = load_file(str(base_adapter / "adapter_model.safetensors"))
    assert set(w.targets) == {(n, m) for n in range(2) for m in ("q_proj", "v_proj")}
    a = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    assert torch.equal(w.lora_a[(1, "v_proj")], a)
    assert w.lora_b[(1, "v_proj")].shape == (shapes.kv_size, 4)
    assert w.targets[(0, "q_proj")].scaling == 2.0
    assert w.digest.startswith("sha256:") and w.max_rank == 4


def test_rank_and_alpha_pattern_against_peft(tiny_llama_path, adapter_factory, shapes):
    """Our per-module rank/scaling equals what PEFT builds when it loads the same adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = adapter_factory(
        tiny_llama_path,
        "cfg-pattern",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "down_proj"],
        rank_pattern={"k_proj": 2, "layers.1.mlp.down_proj": 4},
        alpha_pattern={r"layers\.0\.self_attn\.q_proj": 5},
    )
    w = load_adapter_weights(path, shapes)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_path), path)
    seen = 0
    for name, module in model.named_modules():
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
            layer = int(name.split(".layers.")[1].split(".")[0])
            ours = w.targets[(layer, name.rsplit(".", 1)[1])]
            assert ours.rank == module.r["default"] and ours.scaling == pytest.approx(
                module.scaling["default"]
            )
            seen += 1
    assert seen == len(w.targets) == 6


def test_file_level_refusals(base_adapter, shapes, tmp_path):
    with pytest.raises(AdapterNotFound):
        load_adapter_weights(tmp_path / "absent", shapes)
    # DoRA without its magnitudes
    with pytest.raises(AdapterInvalid, match="lora_magnitude_vector") as e:
        load_adapter_weights(edited_copy(base_adapter, tmp_path / "dora", use_dora=True), shapes)
    assert e.value.field == "adapter_model.safetensors"
    # rank in the config disagrees with the tensors: malformed
    with pytest.raises(AdapterInvalid) as e:
        load_adapter_weights(edited_copy(base_adapter, tmp_path / "r8", r=8), shapes)
    assert e.value.field == "r"
    # config targets a module the file has no tensors for: malformed
    with pytest.raises(AdapterInvalid) as e:
        load_adapter_weights(
            edited_copy(base_adapter, tmp_path / "k", target_modules=["q_proj", "v_proj", "k_proj"]), shapes
        )
    assert "missing tensors" in e.value.message
    # another base model's widths: incompatible, not invalid
    other = ModelShapes(num_layers=2, hidden_size=96, intermediate_size=128, q_size=96, kv_size=48)
    with pytest.raises(AdapterIncompatible) as e:
        load_adapter_weights(base_adapter, other)
    assert "another base model" in e.value.message
    # an extra (bias) tensor: malformed
    bad = edited_copy(base_adapter, tmp_path / "bias")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.zeros(64)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterInvalid) as e:
        load_adapter_weights(bad, shapes)
    assert "lora_B.bias" in e.value.message
