"""The store's checks of the adapter kinds beyond plain A/B pairs (adapter_store/kinds_check.py), on
real PEFT files through `validate_adapter`: DoRA magnitudes, LoRA on embed_tokens / lm_head (with
PEFT's copies of the base layers) accepted; each broken variant refused naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapter_store.base_model import load_base_model_shapes
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import parse_lora_config
from loraplex.adapter_store.validate import validate_adapter

WEIGHTS = "adapter_model.safetensors"
EMBED = "base_model.model.model.embed_tokens"
HEAD = "base_model.model.lm_head"


@pytest.fixture(scope="module")
def vocab_adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path, "store-kinds-vocab", r=4, target_modules=["embed_tokens", "lm_head", "q_proj"]
    )


def validate(directory: Path, base_path: Path):
    config = parse_lora_config((directory / "adapter_config.json").read_bytes())
    return validate_adapter(config, directory / WEIGHTS, load_base_model_shapes(str(base_path)))


def edited(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / WEIGHTS))
    change(t)
    save_file(t, str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst


def test_vocab_and_dora_adapters_are_accepted(vocab_adapter, tiny_llama_path, adapter_factory):
    keys = load_file(str(vocab_adapter / WEIGHTS)).keys()
    assert f"{EMBED}.base_layer.weight" in keys and f"{HEAD}.lora_B.weight" in keys  # PEFT's layout
    assert validate(vocab_adapter, tiny_llama_path).rank == 4
    dora = adapter_factory(tiny_llama_path, "store-kinds-dora", r=4, target_modules=["q_proj"], use_dora=True)
    assert validate(dora, tiny_llama_path).rank == 4


@pytest.mark.parametrize(
    "case, change, field, text",
    [
        (
            "embedding-vocab",
            lambda t: t.update({f"{EMBED}.lora_embedding_A": torch.ones(4, 100)}),
            f"{WEIGHTS}:{EMBED}.lora_embedding_A.shape",
            "vocabulary",
        ),
        (
            "head-rank",
            lambda t: t.update({f"{HEAD}.lora_A.weight": torch.ones(3, 64)}),
            f"{WEIGHTS}:{HEAD}.lora_A.weight.shape",
            "rank 3",
        ),
        (
            "head-missing-b",
            lambda t: t.pop(f"{HEAD}.lora_B.weight"),
            f"{WEIGHTS}:{HEAD}",
            "no matching lora_B",
        ),
        (
            "base-copy-shape",
            lambda t: t.update({f"{HEAD}.base_layer.weight": torch.ones(10, 64)}),
            f"{WEIGHTS}:{HEAD}.base_layer.weight.shape",
            "vocabulary, hidden",
        ),
    ],
)
def test_broken_vocab_tensors_are_refused(
    vocab_adapter, tiny_llama_path, tmp_path, case, change, field, text
):
    with pytest.raises(InvalidArgument) as e:
        validate(edited(vocab_adapter, tmp_path / case, change), tiny_llama_path)
    assert e.value.field == field and text in str(e.value), (e.value.field, str(e.value))


def test_untargeted_lm_head_is_refused(tiny_llama_path, adapter_factory, tmp_path):
    plain = adapter_factory(tiny_llama_path, "store-kinds-plain", r=4, target_modules=["q_proj"])

    def add_head(t):
        t[f"{HEAD}.lora_A.weight"], t[f"{HEAD}.lora_B.weight"] = torch.ones(4, 64), torch.ones(49152, 4)

    with pytest.raises(InvalidArgument, match="not in target_modules"):
        validate(edited(plain, tmp_path / "head", add_head), tiny_llama_path)


@pytest.fixture(scope="module")
def tokens_adapter(tiny_llama_path, adapter_factory) -> Path:
    layers = {"embed_tokens": [3, 5, 9], "lm_head": [3, 7]}
    return adapter_factory(
        tiny_llama_path, "store-kinds-tokens", r=4, target_modules=["q_proj"], trainable_token_indices=layers
    )


def test_trainable_tokens_accepted_and_checked(tokens_adapter, tiny_llama_path, tmp_path):
    assert validate(tokens_adapter, tiny_llama_path).rank == 4
    rows = "base_model.model.lm_head.token_adapter.trainable_tokens_delta"
    with pytest.raises(InvalidArgument) as e:
        validate(
            edited(tokens_adapter, tmp_path / "rows", lambda t: t.update({rows: torch.ones(3, 64)})),
            tiny_llama_path,
        )
    assert e.value.field == f"{WEIGHTS}:{rows}.shape"
    beyond = tmp_path / "beyond"
    shutil.copytree(tokens_adapter, beyond)
    cfg = json.loads((beyond / "adapter_config.json").read_text())
    cfg["trainable_token_indices"]["lm_head"] = [3, 49152]  # the tiny model's vocabulary is 49152
    (beyond / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidArgument, match="past the vocabulary") as e:
        validate(beyond, tiny_llama_path)
    assert e.value.field == "adapter_config.json:trainable_token_indices"
