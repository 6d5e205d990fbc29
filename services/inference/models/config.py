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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# A config.json without `architectures` is loaded by transformers from `model_type`; so here.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served by this engine; the message says why and what to do."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


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
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    if arch == "LlamaForCausalLM":
        sliding = None
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    eos = _as_ids(raw.get("eos_token_id"))
    if generation:
        eos = tuple(dict.fromkeys(eos + _as_ids(generation.get("eos_token_id"))))
    max_pos = int(raw.get("max_position_embeddings", 4096))
    if not math.isfinite(float(raw.get("rms_norm_eps", 1e-6))):
        raise UnsupportedModelError("rms_norm_eps must be finite")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=eos,
        sliding_window=int(sliding) if sliding else None,
    )


def check_context_length(config: ModelConfig, context_length: int) -> None:
    """Refuse sliding-window attention when it would actually cut the context."""
    if config.sliding_window is not None and config.sliding_window < context_length:
        raise UnsupportedModelError(
            f"{config.architecture} uses sliding-window attention (sliding_window={config.sliding_window}), "
            f"which this engine does not implement; pass --context-length {config.sliding_window} or less "
            "to serve it within the window"
        )


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise UnsupportedModelError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    raw = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return parse_config(raw, generation)
