"""The fixtures themselves produce what PEFT and transformers read back."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open


def test_tiny_llama_is_a_loadable_hf_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.num_key_value_heads == 2
    ids = tok("hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_peft_adapter_has_nonzero_b_and_changes_output(tiny_llama_path, adapter_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = adapter_factory(tiny_llama_path, "fx", r=4, target_modules=["q_proj", "down_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "down_proj"}
    with safe_open(path / "adapter_model.safetensors", "pt") as f:
        b_keys = [k for k in f.keys() if "lora_B" in k]
        assert b_keys and all(f.get_tensor(k).abs().sum() > 0 for k in b_keys)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    ids = torch.arange(1, 9)[None]
    base_logits = base(ids).logits
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_path), path)
    assert not torch.allclose(peft(ids).logits, base_logits)
