"""Builders for real test artifacts: tiny HF model directories of every served family and PEFT adapters.

Everything here writes what transformers' `save_pretrained` and PEFT's `save_pretrained`
write, so code under test reads the same files it reads in production.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# (tokenizer directory, its files) -> the tokenizer loaded from it: every tiny model copies SmolLM2's,
# and loading it costs ~0.2 s (a tokenizer is only saved here, never changed).
_LOADED_TOKENIZERS: dict[tuple, Any] = {}


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return loaded_once(_LOADED_TOKENIZERS, path, AutoTokenizer.from_pretrained)


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
    **family_kw: Any,
) -> Path:
    """Write a random tiny causal LM (and a tokenizer, copied from `tokenizer_from`) to `path`.

    With `tokenizer_from` (the SmolLM2 directory) the vocab matches that tokenizer, so
    text prompts work; without it the model has `vocab_size` (default 256) and no tokenizer.
    `arch`: llama, qwen2, or one of FAMILY_CONFIGS (whose features are on; `family_kw` overrides).
    """
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _tokenizer(Path(tokenizer_from)) if tokenizer_from else None
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
    elif arch in FAMILY_CONFIGS:
        config_cls, model_cls, features = FAMILY_CONFIGS[arch]
        model = getattr(transformers, model_cls)(
            getattr(transformers, config_cls)(**{**common, **features, **family_kw})
        )
        with torch.no_grad():  # norm weights start at 0 (Gemma) or 1: make every one of them matter
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.normal_(0, 0.3).add_(0.0 if "gemma" in arch else 1.0)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    with torch.no_grad():
        # Larger-than-default weights so greedy decoding is not a flat argmax over ties.
        for p in model.parameters():
            if p.dim() in (2, 3):  # 3: transformers' stacked experts (saved per expert)
                p.normal_(0, 0.2)
    model = model.to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


# arch -> (transformers config class, model class, the family's features switched on). Windows are
# smaller than the tests' contexts (prompt + 24 new tokens), soft-capping thresholds small enough to bite.
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=12,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_hidden_layers=3,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=32,
            pad_token_id=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            sliding_window=12,
            pad_token_id=0,
            original_max_position_embeddings=512,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.25 * i for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
                "original_max_position_embeddings": 512,
            },
        ),
    ),
    # Mixture-of-experts (2+ layers, 8 experts, top-2): Mixtral renormalises the top-2 weights and
    # windows every layer; this Qwen3-MoE does not renormalise and keeps a dense MLP in layer 1.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=12),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        ),
    ),
}


def files_key(path: Path) -> tuple:
    """A directory's files with their sizes and modification times: what its contents are."""
    files = (f for f in sorted(path.iterdir()) if f.is_file())
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def loaded_once(cache: dict, path: Path, load: Callable[[Path], Any]) -> Any:
    """`load(path)`, kept in `cache` by the directory and its files (`files_key`), so a directory
    rewritten in place is loaded again."""
    key = (str(path.resolve()), files_key(path))
    if key not in cache:
        cache[key] = load(path)
    return cache[key]


# (base directory, its files' sizes and modification times) -> the base as loaded; an adapter starts
# from a copy (PEFT injects its layers into the model it is given). A session makes ~100 adapters on a
# handful of bases: loading each base once instead of per adapter saves seconds of the unit tier.
_LOADED_BASES: dict[tuple, torch.nn.Module] = {}


def _fresh_base(base_path: Path) -> torch.nn.Module:
    """A float32 copy of the model at `base_path`, as `from_pretrained` loads it; the directory's
    files are part of the key, so a base rewritten in place is loaded again."""
    import copy

    from transformers import AutoModelForCausalLM

    def load(path: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    return copy.deepcopy(loaded_once(_LOADED_BASES, Path(base_path), load))


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
    target_parameters: list[str] | None = None,
    use_dora: bool = False,
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None,
) -> Path:
    """Make a real PEFT LoRA adapter for the model at `base_path` with nonzero A and B.

    PEFT initialises B to zero (the adapter is then a no-op); we overwrite A and B with
    seeded random values so the adapter changes the output, then `save_pretrained`. With
    `use_dora`, PEFT's magnitudes (initialised to the rows' norms, a no-op) are scaled by random
    factors in [0.5, 1.5) too; `trainable_token_indices` rows get random values.
    """
    from peft import LoraConfig, get_peft_model

    base = _fresh_base(base_path)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        target_parameters=target_parameters,  # the stacked experts of MoE bases
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=use_dora,
        trainable_token_indices=trainable_token_indices,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_embedding_" in name:  # embed_tokens: A [r, vocab], B [hidden, r]
                param.copy_(torch.randn(param.shape, generator=gen) * scale / min(param.shape) ** 0.5)
            elif "lora_A" in name or "lora_B" in name:
                fan = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) * scale / fan**0.5)
            elif "trainable_tokens_delta" in name:  # the rows' new values (PEFT starts from the base's)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif "lora_magnitude_vector" in name:
                param.mul_(0.5 + torch.rand(param.shape, generator=gen))
    model = model.to(dtype)
    out_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_path, safe_serialization=True)
    return out_path
