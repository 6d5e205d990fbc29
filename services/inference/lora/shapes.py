"""The base model's dimensions as LoRA sees them: per-module input/output widths and paths.

Derived from the HF `config.json` alone, so adapter validation needs no model weights.
Every served family has the module tree `model.layers.N.{self_attn,mlp}.X_proj`; Phi-3's has the
fused `qkv_proj` and `gate_up_proj` in place of q/k/v and gate/up (`fused_checkpoint`). An adapter
of a fused module (one A, one B spanning the fused output) is served as its parts: each part gets
the same A and its rows of B, so the pool and kernels see q/k/v and gate/up of the same rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.services.inference.lora.backend import GROUPS

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTN_MODULES + MLP_MODULES
MODULE_GROUP: dict[str, str] = {m: g for g, mods in GROUPS.items() for m in mods}
# A fused HF module -> the modules it stacks, in its output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_OF: dict[str, str] = {part: fused for fused, parts in FUSED_MODULES.items() for part in parts}
HF_FUSED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShapes:
    """Widths of the seven LoRA-targetable projections, identical in every layer."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    fused_checkpoint: bool = False  # the HF model has qkv_proj / gate_up_proj (Phi-3)
    # A mixture-of-experts base (Mixtral, Qwen3-MoE): adapters may target attention only; LoRA on the
    # experts' (or a dense layer's) projections is refused, naming them.
    moe: bool = False
    # The experts of a mixture-of-experts base, for LoRA on them (lora/expert_targets.py): how many
    # per sparse layer, each expert's intermediate width, and which layers are sparse.
    num_experts: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()
    # The vocabulary (embedding and lm_head rows), for LoRA on embed_tokens / lm_head and trainable
    # tokens (lora/embedding_lora.py); 0: unknown (such adapters are refused).
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    @property
    def hf_modules(self) -> tuple[str, ...]:
        """The targetable linears of the HF module tree, as PEFT names them."""
        if self.moe:
            return ATTN_MODULES
        return HF_FUSED_MODULES if self.fused_checkpoint else ALL_MODULES

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> ModelShapes:
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        kv_heads = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or hidden // heads)
        moe = is_moe_architecture(get("architectures"), get("model_type"))
        num_layers = int(get("num_hidden_layers"))
        experts, expert_inter, sparse = _experts_of(get, num_layers) if moe else (0, 0, ())
        return cls(
            num_layers=num_layers,
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size")),
            q_size=heads * head_dim,
            kv_size=kv_heads * head_dim,
            fused_checkpoint=is_fused_architecture(get("architectures"), get("model_type")),
            moe=moe,
            num_experts=experts,
            expert_intermediate_size=expert_inter,
            sparse_layers=sparse,
            vocab_size=int(get("vocab_size") or 0),
            # absent: tied for Gemma, as models/config.py reads it
            tie_word_embeddings=bool(
                get("tie_word_embeddings", str(get("model_type") or "").startswith("gemma"))
            ),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShapes:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as in `nn.Linear(in, out)`."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "qkv_proj": (h, self.q_size + 2 * self.kv_size),
            "gate_up_proj": (h, 2 * i),
        }[module]

    def group_in(self, group: str) -> int:
        return self.module_dims(GROUPS[group][0])[0]

    def group_widths(self, group: str) -> tuple[int, ...]:
        return tuple(self.module_dims(m)[1] for m in GROUPS[group])


def shapes_of_model(cfg: Any) -> ModelShapes:
    """The shapes of a loaded `models.config.ModelConfig` (no config.json read)."""
    moe = cfg.moe
    return ModelShapes(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        q_size=cfg.q_size,
        kv_size=cfg.kv_size,
        fused_checkpoint=cfg.family.fused_checkpoint,
        moe=moe is not None,
        num_experts=moe.num_experts if moe else 0,
        expert_intermediate_size=moe.intermediate_size if moe else 0,
        sparse_layers=moe.sparse_layers if moe else (),
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def _experts_of(get: Any, num_layers: int) -> tuple[int, int, tuple[bool, ...]]:
    """(experts, expert intermediate width, sparse layers) as models/config.py `_moe_config` reads
    them: Mixtral's every layer; Qwen3-MoE's `decoder_sparse_step` minus its `mlp_only_layers`."""
    if "MixtralForCausalLM" in (get("architectures") or []) or get("model_type") == "mixtral":
        return int(get("num_local_experts")), int(get("intermediate_size")), (True,) * num_layers
    experts = int(get("num_experts") or get("num_local_experts") or 0)
    inter = int(get("moe_intermediate_size") or get("intermediate_size"))
    step = max(1, int(get("decoder_sparse_step") or 1))
    dense = {int(i) for i in get("mlp_only_layers") or ()}
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return experts, inter, sparse


def is_fused_architecture(architectures: list[str] | None, model_type: str | None) -> bool:
    return "Phi3ForCausalLM" in (architectures or []) or (not architectures and model_type == "phi3")


MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}


def is_moe_architecture(architectures: list[str] | None, model_type: str | None) -> bool:
    archs = architectures or []
    return any(a in MOE_ARCHITECTURES for a in archs) or (
        not archs and model_type in MOE_ARCHITECTURES.values()
    )


def module_path(layer: int, module: str) -> str:
    """The module's name in the HF model (`named_modules()` of *ForCausalLM), as PEFT keys it."""
    block = "self_attn" if module in ATTN_MODULES or module == "qkv_proj" else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def all_module_paths(num_layers: int, modules: tuple[str, ...] = ALL_MODULES) -> list[str]:
    """Every module name of the HF model tree, so PEFT's target matching can be replayed."""
    names = ["", "model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for n in range(num_layers):
        p = f"model.layers.{n}"
        names += [
            p,
            f"{p}.self_attn",
            f"{p}.mlp",
            f"{p}.mlp.act_fn",
            f"{p}.input_layernorm",
            f"{p}.post_attention_layernorm",
        ]
        names += [module_path(n, m) for m in modules]
    return names


# The experts' stacked parameters PEFT targets with `target_parameters` (transformers 5:
# `mlp.experts.gate_up_proj` [E, 2*I, H] and `mlp.experts.down_proj` [E, H, I]), in the order the
# experts module registers them (which decides PEFT's wrapper nesting, lora/expert_targets.py), and
# the names `--lora-target-modules` gives them.
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EXPERT_MODULES = tuple(f"experts.{p}" for p in EXPERT_PARAMS)


def expert_dims(shapes: ModelShapes, param: str) -> tuple[int, int]:
    """(in_features, out_features) of one expert's projection `param` (gate_up_proj, down_proj)."""
    h, i = shapes.hidden_size, shapes.expert_intermediate_size
    return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}[param]


def sparse_layer_indices(shapes: ModelShapes) -> list[int]:
    """The layers whose MLP is the experts."""
    return [n for n, sparse in enumerate(shapes.sparse_layers) if sparse]
