"""DoRA adapters on the inference side: magnitudes read and checked at load, the per-row factor
`m / ||W + sBA||` computed once, applied per token only to DoRA rows (both ways a backend hands
its delta over), and refused under tensor parallelism.
PEFT exactness: tests/integration/test_lora_kinds.py; the scale kernel under the Triton interpreter:
tests/integration/test_kernels_lora.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.dora import fill_factors
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend

WEIGHTS = "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def dora_adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path, "dora-unit", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], use_dora=True
    )


@pytest.fixture(scope="module")
def base_weights(tiny_llama_path, shapes) -> dict[tuple[int, str], torch.Tensor]:
    state = load_file(str(tiny_llama_path / "model.safetensors"))
    group = {
        m: "mlp" if m.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn" for m in ALL_MODULES
    }
    return {
        (n, m): state[f"model.layers.{n}.{group[m]}.{m}.weight"]
        for n in range(shapes.num_layers)
        for m in ALL_MODULES
    }


def edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        t = load_file(str(dst / WEIGHTS))
        tensors(t)
        save_file(t, str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst


def test_magnitudes_read_and_factor_is_peft_definition(dora_adapter, shapes, base_weights):
    w = load_adapter_weights(dora_adapter, shapes)
    assert sorted(w.dora_magnitude) == sorted(w.targets) and len(w.targets) == 4
    fill_factors(w, lambda n, m: base_weights[(n, m)])
    raw = load_file(str(dora_adapter / WEIGHTS))
    a, b = raw[f"{Q0}.lora_A.weight"], raw[f"{Q0}.lora_B.weight"]
    m = raw[f"{Q0}.lora_magnitude_vector"]
    s = w.targets[(0, "q_proj")].scaling
    expected = m / torch.linalg.norm(base_weights[(0, "q_proj")] + s * (b @ a), dim=1)
    torch.testing.assert_close(w.dora_factor[(0, "q_proj")], expected)
    assert not torch.allclose(expected, torch.ones_like(expected))  # the magnitudes are not a no-op


def test_magnitude_refusals(dora_adapter, shapes, tmp_path):
    key = f"{Q0}.lora_magnitude_vector"

    def negative(t):
        t[key][3] = -1.0

    with pytest.raises(AdapterInvalid, match="finite and positive") as e:
        load_adapter_weights(edited(dora_adapter, tmp_path / "neg", tensors=negative), shapes)
    assert "row 3" in e.value.message

    def nan(t):
        t[key][0] = float("nan")

    with pytest.raises(AdapterInvalid, match="finite and positive"):
        load_adapter_weights(edited(dora_adapter, tmp_path / "nan", tensors=nan), shapes)
    with pytest.raises(AdapterInvalid, match="use_dora is not true") as e:
        load_adapter_weights(edited(dora_adapter, tmp_path / "nodora", config={"use_dora": False}), shapes)
    assert e.value.field == "use_dora"

    def short(t):
        t[key] = t[key][:-1].clone()

    with pytest.raises(AdapterIncompatible, match="another base model"):
        load_adapter_weights(edited(dora_adapter, tmp_path / "short", tensors=short), shapes)


def test_refused_without_base_weights_as_under_tensor_parallelism(dora_adapter, shapes):
    pool = AdapterPool(
        shapes, slots=2, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(AdapterIncompatible, match="tensor parallelism") as e:
        LoRAManager(pool).load_adapter("d", dora_adapter)
    assert e.value.field == "use_dora"


def test_factor_applies_to_dora_rows_only_in_both_handovers(
    dora_adapter, tiny_llama_path, adapter_factory, shapes, base_weights
):
    """Tokens of a DoRA slot are scaled per row; tokens of a plain slot and of no adapter are not;
    a delta handed back (the side-stream backend) gives what a delta added in place gives."""
    plain = adapter_factory(tiny_llama_path, "dora-unit-plain", r=4, target_modules=["q_proj"])
    pool = AdapterPool(
        shapes, slots=2, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    manager = LoRAManager(pool, base_weight=lambda n, m: base_weights[(n, m)])
    manager.load_adapter("dora", dora_adapter)
    manager.load_adapter("plain", plain)
    slots = {name: manager.acquire(name) for name in ("dora", "plain")}
    backend = TorchLoRABackend(pool)
    token_slots = [slots["dora"], slots["dora"], slots["plain"], -1]
    assert backend.step_has_kinds(token_slots) and not backend.step_has_kinds([slots["plain"], -1])
    backend.kinds_step = True
    backend.prepare(torch.tensor(token_slots, dtype=torch.int32))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, shapes.hidden_size, generator=gen)
    weight = torch.cat([base_weights[(0, m)] for m in ("q_proj", "k_proj", "v_proj")])
    bias = torch.randn(weight.shape[0], generator=gen)
    base = x @ weight.T + bias
    in_place = base.clone()
    backend.apply(0, "qkv", x, in_place)
    delta = in_place - base
    got_in_place = backend.dora(0, "qkv", in_place.clone(), None, bias)  # scales `out` in place
    got_handed = backend.dora(0, "qkv", base.clone(), delta, bias)
    torch.testing.assert_close(got_in_place, got_handed)
    factor = manager.pool.dora.factors["qkv"][0, slots["dora"]]
    torch.testing.assert_close(got_in_place[:2], (in_place[:2] - bias) * factor + bias)
    torch.testing.assert_close(got_in_place[2:], in_place[2:])  # plain adapter and no adapter untouched


def test_embedding_lora_refused_under_tensor_parallelism(tiny_llama_path, adapter_factory, shapes):
    """A manager without the base weights is a sharded model's: the vocabulary is split across ranks."""
    vocab = adapter_factory(tiny_llama_path, "dora-unit-vocab", r=4, target_modules=["lm_head", "q_proj"])
    pool = AdapterPool(
        shapes, slots=2, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(AdapterIncompatible, match="vocabulary is sharded") as e:
        LoRAManager(pool).load_adapter("v", vocab)
    assert e.value.field == "target_modules"
