"""Hub-style config.json files of the new families (the transformers 4.x spellings their published
checkpoints use) parse into the windows, ropes and scales transformers derives from them."""

from __future__ import annotations

import math

import torch

from loraplex.services.inference.models.config import parse_config
from loraplex.services.inference.models.rope import inverse_frequencies

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    rms_norm_eps=1e-6,
)


def test_gemma2_hub_config():
    cfg = parse_config(
        {
            **COMMON,
            "architectures": ["Gemma2ForCausalLM"],
            "num_hidden_layers": 4,
            "head_dim": 32,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 256,
            "cache_implementation": "hybrid",
        }
    )
    assert cfg.layer_windows == (4096, None, 4096, None)  # even layers slide, as transformers' is_sliding
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attention_scale) == (50.0, 30.0, 256**-0.5)
    assert cfg.activation == "gelu_tanh" and cfg.tie_word_embeddings  # Gemma ties by default
    assert cfg.family.sandwich_norms and cfg.family.norm_unit_offset and not cfg.family.qk_norm


def test_gemma3_hub_config_has_a_local_rope_and_a_one_in_six_global_pattern():
    cfg = parse_config(
        {
            **COMMON,
            "model_type": "gemma3_text",
            "architectures": None,
            "num_hidden_layers": 7,
            "head_dim": 32,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "query_pre_attn_scalar": 256,
        }
    )
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows == (1024,) * 5 + (None, 1024)
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 8.0
    assert cfg.local_rope.theta == 10000.0 and cfg.local_rope.rope_type == "default"
    assert cfg.attn_softcap is None and cfg.family.qk_norm


def test_phi3_longrope_matches_transformers():
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short = [1.0 + 0.1 * i for i in range(8)]
    raw = {
        **COMMON,
        "architectures": ["Phi3ForCausalLM"],
        "num_hidden_layers": 2,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "sliding_window": 262144,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "su", "short_factor": short, "long_factor": [2.0] * 8},
    }
    cfg = parse_config(raw)
    assert cfg.rope.rope_type == "longrope" and cfg.family.fused_checkpoint
    # (transformers' own config class wants the original length inside rope_scaling)
    scaling = {**raw["rope_scaling"], "original_max_position_embeddings": 4096}
    ref_cfg = Phi3Config(
        **{**{k: v for k, v in raw.items() if k != "architectures"}, "rope_scaling": scaling}
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](ref_cfg, None)
    assert torch.equal(inverse_frequencies(cfg.rope, cfg.head_dim), inv_freq)
    assert math.isclose(cfg.rope.attention_factor, attention_factor, rel_tol=1e-12)


def test_qwen3_windows_only_with_use_sliding_window():
    raw = {**COMMON, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "head_dim": 16,
           "sliding_window": 32, "max_window_layers": 2}  # fmt: skip
    assert parse_config(raw).layer_windows == (None,) * 4
    assert parse_config({**raw, "use_sliding_window": True}).layer_windows == (None, None, 32, 32)
