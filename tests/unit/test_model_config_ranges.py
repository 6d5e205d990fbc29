"""config.json's numbers are range-checked before anything is sized from them (issue 59, L5 and M6):
each refusal is one line naming the key."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from loraplex.services.inference.models.config import UnsupportedModelError, parse_config
from loraplex.services.inference.models.loader import load_model

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
MISTRAL = {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 16}

REFUSED = [
    ({"max_position_embeddings": 0}, "max_position_embeddings"),  # crashed warm-up with a traceback
    ({"vocab_size": 2**31}, "vocab_size"),  # tried to allocate 512 GiB
    ({"vocab_size": 0}, "vocab_size"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"hidden_size": True}, "hidden_size"),
    ({"intermediate_size": 2**40}, "intermediate_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_attention_heads": 4.5}, "num_attention_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"head_dim": -1}, "head_dim"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "rope_scaling.factor"),
]


@pytest.mark.parametrize(
    "change, key", REFUSED, ids=[r[1] + "=" + repr(list(r[0].values())[0]) for r in REFUSED]
)
def test_out_of_range_values_are_refused_naming_the_key(change, key):
    with pytest.raises(UnsupportedModelError) as e:
        parse_config({**BASE, **change})
    message = str(e.value)
    assert message.startswith(f"config.json: {key} must be") and "\n" not in message, message


@pytest.mark.parametrize("window", [-1, -4096, 2.5, "16"])
def test_a_negative_or_non_integer_sliding_window_is_refused(window):
    with pytest.raises(
        UnsupportedModelError, match=r"^config.json: sliding_window must be a positive integer"
    ):
        parse_config({**MISTRAL, "sliding_window": window})


def test_in_range_values_still_parse():
    assert parse_config(MISTRAL).sliding_window == 16
    assert parse_config({**MISTRAL, "sliding_window": None}).sliding_window is None
    assert parse_config({**BASE, "rms_norm_eps": 0, "head_dim": None}).head_dim == 16
    gemma3 = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 16,
        "sliding_window": 8,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    }
    assert parse_config(gemma3).rope.factor == 2.0
    with pytest.raises(UnsupportedModelError, match=r"rope_parameters.full_attention.rope_theta must be"):
        bad = {**gemma3["rope_parameters"], "full_attention": {"rope_type": "default", "rope_theta": -1.0}}
        parse_config({**gemma3, "rope_parameters": bad})


def test_a_huge_vocab_is_refused_at_load_before_any_allocation(tiny_llama_path, tmp_path):
    d = tmp_path / "huge-vocab"
    shutil.copytree(tiny_llama_path, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 2**31}))
    started = time.monotonic()
    with pytest.raises(UnsupportedModelError, match=r"^config.json: vocab_size must be a positive integer"):
        load_model(d, torch.device("cpu"), torch.float32)
    assert time.monotonic() - started < 5
