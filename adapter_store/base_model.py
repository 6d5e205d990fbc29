"""What the base model's config says each target linear's (in, out) must be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

MAX_BASE_CONFIG_BYTES = 16 * 2**20  # a model's config.json is a few KB
MOE_ARCHITECTURES = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"}
MOE_MODEL_TYPES = {"mixtral", "qwen3_moe"}


class ExpertShapes(NamedTuple):
    """The stacked experts of a mixture-of-experts base (transformers 5 `mlp.experts`)."""

    num_experts: int
    sparse_layers: tuple[bool, ...]
    # parameter (gate_up_proj, down_proj) -> one expert's (in_features, out_features)
    params: dict[str, tuple[int, int]]


class BaseModelShapes(NamedTuple):
    name: str
    num_layers: int
    # module suffix (q_proj, ...) -> (in_features, out_features)
    linears: dict[str, tuple[int, int]]
    experts: ExpertShapes | None = None  # None: not a mixture-of-experts base

    def expected(self, module_suffix: str) -> tuple[int, int] | None:
        return self.linears.get(module_suffix)


def shapes_from_config(name: str, config: dict) -> BaseModelShapes:
    """Decoder shapes from a transformers `config.json` dict: q/k/v/o and gate/up/down, or for Phi-3
    (whose checkpoints fuse them) qkv_proj, o_proj, gate_up_proj, down_proj."""
    cfg = config.get("text_config", config)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    linears = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    if "Phi3ForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "phi3":
        linears = {
            "qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
            "o_proj": linears["o_proj"],
            "gate_up_proj": (hidden, 2 * inter),
            "down_proj": linears["down_proj"],
        }
    experts = None
    if set(cfg.get("architectures") or []) & MOE_ARCHITECTURES or cfg.get("model_type") in MOE_MODEL_TYPES:
        # Mixtral / Qwen3-MoE: the server applies LoRA to attention and to the experts (target_parameters).
        linears = {m: linears[m] for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        experts = _experts(cfg, hidden)
    if "vocab_size" in cfg:
        linears["lm_head"] = (hidden, int(cfg["vocab_size"]))
    return BaseModelShapes(name, int(cfg["num_hidden_layers"]), linears, experts)


def _experts(cfg: dict, hidden: int) -> ExpertShapes:
    """As the inference server reads them (models/config.py): Mixtral's every layer; Qwen3-MoE's
    `decoder_sparse_step` minus its `mlp_only_layers`."""
    layers = int(cfg["num_hidden_layers"])
    if "MixtralForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "mixtral":
        count, inter, sparse = (
            int(cfg.get("num_local_experts", 8)),
            int(cfg["intermediate_size"]),
            (True,) * layers,
        )
    else:
        count = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        step = max(1, int(cfg.get("decoder_sparse_step") or 1))
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(i not in dense and count > 0 and (i + 1) % step == 0 for i in range(layers))
    return ExpertShapes(count, sparse, {"gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)})


def load_base_model_shapes(
    path_or_id: str, *, endpoint: str | None = None, token: str | None = None, cache_dir: Path | None = None
) -> BaseModelShapes:
    """Read `config.json` from a local model directory, or fetch just that file from the Hub."""
    local = Path(path_or_id).expanduser()
    if local.is_dir():
        config_path = local / "config.json"
    else:
        from huggingface_hub import hf_hub_download

        from loraplex.adapter_store.progress import DownloadBudget, bounded_progress

        # Counted as it arrives, like the adapters' files: an endpoint may advertise a few KB and
        # then stream without end.
        budget = DownloadBudget(
            MAX_BASE_CONFIG_BYTES,
            f"hf://{path_or_id}/config.json",
            limit_name="the base model config's limit",
        )
        config_path = Path(
            hf_hub_download(
                path_or_id,
                "config.json",
                endpoint=endpoint,
                token=token,
                cache_dir=cache_dir,
                tqdm_class=bounded_progress(budget),
            )
        )
    return shapes_from_config(path_or_id, json.loads(config_path.read_text()))
