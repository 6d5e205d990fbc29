"""The subset of a Hugging Face `config.json` the engine runs, and the refusals at start.

We read config.json ourselves (not AutoConfig) so a checkpoint that needs remote code is
refused before any of its code could be imported, and so both the transformers 4.x
(`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are understood.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.services.inference.models.config_checks import check_config_ranges
from loraplex.services.inference.models.errors import UnsupportedModelError
from loraplex.services.inference.models.families import (
    ACTIVATIONS,
    ARCHITECTURE_OF_MODEL_TYPE,
    FAMILIES,
    LLAMA,
    SUPPORTED_ARCHITECTURES,
    FamilyTraits,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Spellings transformers reads as longrope (Phi-3's older configs say "su").
_ROPE_ALIASES = {"su": "longrope"}
LAYER_TYPES = ("full_attention", "sliding_attention")

__all__ = ["ARCHITECTURE_OF_MODEL_TYPE", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors and the factor cos/sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoEConfig:
    """The experts of a sparse MLP: each token goes to `top_k` of `num_experts` gated MLPs of width
    `intermediate_size`, weighted by the router's softmax (over all experts, then the top k,
    renormalised to sum 1 when `norm_topk_prob`: always for Mixtral, per config for Qwen3-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP (Qwen3-MoE mlp_only_layers)


def _moe_config(family: FamilyTraits, raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    if family.moe is None:
        return None
    if family.moe == "mixtral":
        experts, inter, norm = int(raw.get("num_local_experts", 8)), int(raw["intermediate_size"]), True
        sparse = (True,) * num_layers
    else:  # qwen3_moe: transformers' Qwen3MoeDecoderLayer picks experts or a dense MLP per layer
        # the Hub's configs say num_experts; transformers 5 saves it as num_local_experts
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        inter = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        norm = bool(raw.get("norm_topk_prob", False))
        step = int(raw.get("decoder_sparse_step", 1))
        if step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step must be >= 1 (got {step})")
        dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
        sparse = tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    top_k = int(raw.get("num_experts_per_tok", 2))
    if any(sparse) and not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
    if raw.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported")
    return MoEConfig(experts, top_k, inter, norm, sparse)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    family: FamilyTraits = LLAMA
    activation: str = "silu"
    # Per layer: the sliding window (keys with q_pos - k_pos < window are seen) or None (global).
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None  # the rope of sliding-window layers, when it differs (Gemma 3)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma), else head_dim's
    moe: MoEConfig | None = None  # a sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts (else a dense MLP of `intermediate_size`)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from(params: dict[str, Any], raw: dict[str, Any], default_theta: float) -> RopeConfig:
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} (rotary on part of each head) is not supported; only 1.0"
        )
    max_pos = int(raw.get("max_position_embeddings", 4096))
    original = int(
        params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", max_pos))
    )
    factor = float(params.get("factor", 1.0))
    attention_factor = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    if rope_type == "longrope":
        # transformers' _compute_longrope_parameters: factor and attention factor from the lengths.
        factor = float(params.get("factor") or max_pos / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        attention_factor = float(attention_factor)
        short_factor = tuple(float(f) for f in params.get("short_factor") or ())
        long_factor = tuple(float(f) for f in params.get("long_factor") or ())
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        short_factor=short_factor,
        long_factor=long_factor,
        attention_factor=attention_factor,
    )


def _rope_config(raw: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    return _rope_from({**scaling, **params}, raw, default_theta)


def _gemma3_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) ropes: transformers 5 writes one `rope_parameters` entry per layer type,
    4.x wrote `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        glob = _rope_from(params.get("full_attention") or {}, {**raw, "rope_theta": 1_000_000.0}, 1e6)
        local = _rope_from(params.get("sliding_attention") or {}, {**raw, "rope_theta": 10_000.0}, 1e4)
        return glob, local
    glob = _rope_config(raw, default_theta=1_000_000.0)
    local = _rope_from({}, {**raw, "rope_theta": float(raw.get("rope_local_base_freq", 10_000.0))}, 1e4)
    return glob, local


def _layer_windows(arch: str, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Which layers attend within a sliding window, as transformers decides it per family."""
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or not window:
        return (None,) * num_layers
    qwens = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch in qwens and not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (an encoder) is not supported")
    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise UnsupportedModelError(
                f"layer_types must name {num_layers} layers, each one of {', '.join(LAYER_TYPES)} "
                f"(got {types!r})"
            )
    elif arch in qwens[:2]:  # Qwen3-MoE: every layer, like Mistral
        first = int(raw.get("max_window_layers", num_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif arch == "Gemma2ForCausalLM":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    else:  # Mistral, Phi-3: every layer
        types = ["sliding_attention"] * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _positive_or_none(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise UnsupportedModelError(f"{key} must be a positive number or null (got {value!r})")
    return float(value)


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Turn a config.json dict into a ModelConfig, refusing what we cannot run faithfully."""
    if raw.get("auto_map"):
        raise UnsupportedModelError(
            "this checkpoint needs trust_remote_code (config.json has auto_map); loraplex never runs "
            "remote code: use a checkpoint of a supported architecture "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in ARCHITECTURE_OF_MODEL_TYPE:
        archs = [ARCHITECTURE_OF_MODEL_TYPE[raw["model_type"]]]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = FAMILIES[arch]
    check_config_ranges(raw)  # each number in range before anything is sized from it
    # Gemma's configs name the MLP activation `hidden_activation` (`hidden_act` is a legacy key).
    act_key = (
        "hidden_activation"
        if family.activation == "gelu_tanh" and "hidden_activation" in raw
        else "hidden_act"
    )
    act = raw.get(act_key) or ("gelu_pytorch_tanh" if family.activation == "gelu_tanh" else "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{act_key} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    num_layers = int(raw["num_hidden_layers"])
    windows = _layer_windows(arch, raw, num_layers)
    sliding = max((w for w in windows if w is not None), default=None)
    if family.local_rope:
        rope, local_rope = _gemma3_ropes(raw)
    else:
        rope, local_rope = _rope_config(raw), None
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    eos = _as_ids(raw.get("eos_token_id"))
    if generation:
        eos = tuple(dict.fromkeys(eos + _as_ids(generation.get("eos_token_id"))))
    max_pos = int(raw.get("max_position_embeddings", 4096))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=rope,
        # Gemma's config class ties by default, so save_pretrained may leave the key out.
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.name.startswith("gemma"))),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=eos,
        sliding_window=sliding,
        family=family,
        activation=ACTIVATIONS[act],
        layer_windows=windows,
        local_rope=local_rope,
        attn_softcap=_positive_or_none(raw, "attn_logit_softcapping"),
        final_softcap=_positive_or_none(raw, "final_logit_softcapping"),
        query_pre_attn_scalar=(
            float(raw.get("query_pre_attn_scalar") or 256) if family.name.startswith("gemma") else None
        ),
        moe=_moe_config(family, raw, num_layers),
    )


def check_context_length(config: ModelConfig, context_length: int) -> None:
    """Refuse a context the rope cannot serve exactly as transformers computes it."""
    rope = config.rope
    if rope.rope_type == "longrope" and context_length > rope.original_max_position_embeddings:
        # transformers switches every position to the long factors once a sequence passes the
        # original length, which would change the rotation of keys already in the KV cache.
        raise UnsupportedModelError(
            f"{config.architecture} uses longrope scaling, whose long factors (past "
            f"original_max_position_embeddings={rope.original_max_position_embeddings}) loraplex does not "
            f"implement; pass --context-length {rope.original_max_position_embeddings} or less"
        )


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise UnsupportedModelError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    raw = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return parse_config(raw, generation)
