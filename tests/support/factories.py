"""Builders for real test artifacts: tiny HF Llama/Qwen2 directories and PEFT adapters.

Everything here writes what transformers' `save_pretrained` and PEFT's `save_pretrained`
write, so code under test reads the same files it reads in production.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_model(
    path: Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    tokenizer_from: Path | None = None,
    seed: int = 0,
) -> Path:
    """Write a random tiny causal LM (and a tokenizer, copied from `tokenizer_from`) to `path`.

    With `tokenizer_from` (the SmolLM2 directory) the vocab matches that tokenizer, so
    text prompts work; without it the model has `vocab_size` (default 256) and no tokenizer.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else None
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 256)
    common = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    if tokenizer is not None:
        common.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(**common, rope_scaling=rope_scaling)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
        model = Qwen2ForCausalLM(config)
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    with torch.no_grad():
        # Larger-than-default weights so greedy decoding is not a flat argmax over ties.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model = model.to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def make_peft_adapter(
    base_path: Path,
    out_path: Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: list[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    scale: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Make a real PEFT LoRA adapter for the model at `base_path` with nonzero A and B.

    PEFT initialises B to zero (the adapter is then a no-op); we overwrite A and B with
    seeded random values so the adapter changes the output, then `save_pretrained`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) * scale / fan**0.5)
    model = model.to(dtype)
    out_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_path, safe_serialization=True)
    return out_path
