"""Every load path of the inference server checks adapter tensors as the store does (issue 59, H3 (a)):
a server without a store (`LoadAdapter` with a path, `--lora-paths`) reads the directory itself, so
`load_adapter_weights` refuses NaN, Inf, values past float16's range and dtypes other than
F16/BF16/F32, on linear modules and on the experts of a mixture-of-experts base alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.services.inference.errors import AdapterInvalid
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.lora.tensor_checks import MAX_WEIGHT_ABS
from tests.unit.test_expert_adapter_checks import CONFIG as EXPERT_CONFIG
from tests.unit.test_expert_adapter_checks import MIXTRAL, _tensors

WEIGHTS = "adapter_model.safetensors"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
EXPERT_A = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"

# (case, how the tensor changes, words the refusal must say)
BAD_TENSORS = [
    ("nan", lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")), "NaN or Inf"),
    ("inf", lambda t: t.index_fill_(0, torch.tensor([0]), float("-inf")), "NaN or Inf"),
    ("huge", lambda t: t.index_fill_(0, torch.tensor([0]), 1e30), "magnitude 1e+30"),
    ("past-f16", lambda t: t.index_fill_(0, torch.tensor([0]), -70000.0), "magnitude 7e+04"),
    ("bf16-huge", lambda t: t.to(torch.bfloat16).index_fill_(0, torch.tensor([0]), 1e20), "magnitude"),
    ("float64", lambda t: t.to(torch.float64), "dtype F64"),
    ("int8", lambda t: t.to(torch.int8), "dtype I8"),
]


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "tensor-checks", r=4, target_modules=["q_proj", "v_proj"])


def _edited(src: Path, dst: Path, key: str, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / WEIGHTS))
    tensors[key] = change(tensors[key].clone()).contiguous()
    save_file(tensors, str(dst / WEIGHTS))
    return dst


@pytest.mark.parametrize("case, change, words", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_linear_adapter_tensor_refused_naming_it(adapter, shapes, tmp_path, case, change, words):
    bad = _edited(adapter, tmp_path / case, Q0_B, change)
    with pytest.raises(AdapterInvalid) as e:
        load_adapter_weights(bad, shapes)
    assert words in e.value.message and Q0_B in e.value.message, e.value.message
    assert e.value.field.startswith(f"{WEIGHTS}:{Q0_B}"), e.value.field


@pytest.fixture(scope="module")
def expert_adapter(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("expert-tensor-checks")
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=gen) * 0.1 for k, s in _tensors().items()}, d / WEIGHTS)
    (d / "adapter_config.json").write_text(json.dumps(EXPERT_CONFIG))
    return d


@pytest.mark.parametrize("case, change, words", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_expert_adapter_tensor_refused_naming_it(expert_adapter, tmp_path, case, change, words):
    moe = ModelShapes.from_hf_config(MIXTRAL)
    load_adapter_weights(expert_adapter, moe)  # the unbroken one loads
    bad = _edited(expert_adapter, tmp_path / case, EXPERT_A, change)
    with pytest.raises(AdapterInvalid) as e:
        load_adapter_weights(bad, moe)
    assert words in e.value.message and EXPERT_A in e.value.message, e.value.message


def test_the_largest_allowed_weight_and_half_precision_files_load(adapter, shapes, tmp_path):
    edge = _edited(
        adapter, tmp_path / "edge", Q0_B, lambda t: t.index_fill_(0, torch.tensor([0]), -MAX_WEIGHT_ABS)
    )
    assert float(load_adapter_weights(edge, shapes).lora_b[(0, "q_proj")].abs().max()) == MAX_WEIGHT_ABS
    for dtype in (torch.float16, torch.bfloat16):
        d = tmp_path / str(dtype)
        shutil.copytree(adapter, d)
        save_file({k: v.to(dtype) for k, v in load_file(str(d / WEIGHTS)).items()}, str(d / WEIGHTS))
        load_adapter_weights(d, shapes)
