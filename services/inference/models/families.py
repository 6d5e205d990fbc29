"""The model families one shared decoder (models/llama.py) serves, and what sets each apart.

Every supported architecture is the Llama decoder (pre-norm residual blocks, GQA attention with
rotary embeddings, a gated MLP) plus a few named differences, switched on per family here; the
values a checkpoint sets (soft-capping thresholds, window sizes, rope bases) are read from its
config.json by models/config.py. A new family is one entry below, the config keys it adds, and
its checkpoint names if they differ (`checkpoint_renames`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FamilyTraits:
    """What one family changes in the shared decoder (all off: Llama)."""

    name: str
    # q and k are RMS-normalised per head (weight `[head_dim]`) before rotary (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorm scales by `1 + weight` in float32, then casts (Gemma), instead of casting, then `weight *`.
    norm_unit_offset: bool = False
    # The attention output and the MLP output are RMS-normalised before their residual adds (Gemma 2/3).
    sandwich_norms: bool = False
    # Embeddings are multiplied by sqrt(hidden_size) in the model dtype (Gemma).
    embed_scale: bool = False
    # The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's gelu_pytorch_tanh).
    activation: str = "silu"
    # The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3).
    fused_checkpoint: bool = False
    # Sliding-window layers use their own rope base (`rope_local_base_freq`, Gemma 3).
    local_rope: bool = False
    # A sparse mixture-of-experts MLP (models/moe.py) and its checkpoint layout: "mixtral"
    # (`block_sparse_moe.{gate,experts.N.w1/w2/w3}`) or "qwen3_moe" (`mlp.{gate,experts.N.gate_proj/
    # up_proj/down_proj}`); None: a dense MLP in every layer.
    moe: str | None = None
    # checkpoint module name (under `model.layers.N.`) -> our module name, where they differ.
    checkpoint_renames: dict[str, str] = field(default_factory=dict)


LLAMA = FamilyTraits("llama")
GEMMA_RENAMES = {
    # Gemma's `post_attention_layernorm` normalises the attention output (before the residual add);
    # its `pre_feedforward_layernorm` is what Llama calls `post_attention_layernorm` (the MLP's input).
    "post_attention_layernorm": "attn_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}

FAMILIES: dict[str, FamilyTraits] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": FamilyTraits("mistral"),
    "Qwen2ForCausalLM": FamilyTraits("qwen2"),
    "Qwen3ForCausalLM": FamilyTraits("qwen3", qk_norm=True),
    "Gemma2ForCausalLM": FamilyTraits(
        "gemma2",
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        activation="gelu_tanh",
        checkpoint_renames=GEMMA_RENAMES,
    ),
    "Gemma3ForCausalLM": FamilyTraits(
        "gemma3",
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        activation="gelu_tanh",
        local_rope=True,
        checkpoint_renames=GEMMA_RENAMES,
    ),
    "Phi3ForCausalLM": FamilyTraits("phi3", fused_checkpoint=True),
    "MixtralForCausalLM": FamilyTraits("mixtral", moe="mixtral"),
    "Qwen3MoeForCausalLM": FamilyTraits("qwen3_moe", qk_norm=True, moe="qwen3_moe"),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# A config.json without `architectures` is loaded by transformers from `model_type`; so here.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The activation names each family's config may give (`hidden_act` / `hidden_activation`).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
