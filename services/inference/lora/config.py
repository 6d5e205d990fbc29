"""Parse and validate a PEFT `adapter_config.json`; resolve its targets against the model.

Two error classes, as the gRPC layer needs them:
- `AdapterInvalid` (INVALID_ARGUMENT): the adapter itself is malformed or uses a PEFT feature
  this engine cannot run (biases, modules_to_save, ...). No server flags would help.
- `AdapterIncompatible` (FAILED_PRECONDITION): well-formed, but this server was started with
  limits it exceeds (rank, target modules) or it belongs to another base model (shapes).
Every refusal names the offending field.

Target and pattern matching replay PEFT 0.21 (`check_target_module_exists`, `get_pattern_key`)
over the model's module names, so per-(layer, module) ranks and scalings equal PEFT's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.shapes import (
    ALL_MODULES,
    ATTN_MODULES,
    FUSED_MODULES,
    all_module_paths,
    module_path,
)
from loraplex.services.inference.lora.trainable_tokens import parse_trainable_tokens

# PEFT features that change the forward beyond `B(A(x)) * scaling`; refused when set.
_UNSUPPORTED: dict[str, str] = {
    "fan_in_fan_out": "fan_in_fan_out is for Conv1D (GPT-2 style) layers; these models use nn.Linear",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
}
EMBEDDING_PATHS = ("model.embed_tokens", "lm_head")


class ModuleLoRA(NamedTuple):
    """One targeted (layer, module): its rank, alpha and the scaling applied to `B(A(x))`."""

    rank: int
    alpha: float
    scaling: float


@dataclass(frozen=True)
class AdapterSpec:
    """A validated PEFT LoRA config, independent of any model."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    base_model_name_or_path: str | None = None
    all_linear: bool = False  # target_modules was "all-linear": every projection of the model's own tree
    # PEFT's LoRA on raw parameters: the stacked experts of Mixtral / Qwen3-MoE (lora/expert_targets.py)
    target_parameters: tuple[str, ...] = ()
    # DoRA (`use_dora`): a learned magnitude per output row of every targeted linear (lora/dora.py)
    use_dora: bool = False
    # PEFT's trainable_token_indices: {"model.embed_tokens" / "lm_head": token ids} (lora/trainable_tokens.py)
    trainable_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _invalid(field_name: str, why: str) -> AdapterInvalid:
    return AdapterInvalid(f"adapter_config.json: {field_name}: {why}", field=field_name)


def _positive_int(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _invalid(field_name, f"must be a positive integer (got {value!r})")
    return value


# The largest lora_alpha (and alpha_pattern value) served: float16's largest value. Real adapters use
# alphas of 1 to a few thousand; an alpha of 1e30 is finite in the float32 scaling table but scales
# every delta past any activation's range (Inf, then NaN logits). The store applies the same bound.
MAX_ALPHA = 65504.0


def _positive_float(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_ALPHA:
        raise _invalid(field_name, f"must be a positive number of at most {MAX_ALPHA:g} (got {value!r})")
    return float(value)


def _str_list_or_regex(value: Any, field_name: str) -> tuple[str, ...] | str:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise _invalid(field_name, f"is not a valid regular expression: {e}") from None
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise _invalid(field_name, f"must be a list of module names or a regex string (got {value!r})")


def parse_adapter_config(cfg: dict[str, Any]) -> AdapterSpec:
    """Validate the config dict as PEFT writes it; raise AdapterInvalid naming the field."""
    if not isinstance(cfg, dict):
        raise AdapterInvalid("adapter_config.json must hold a JSON object", field="adapter_config.json")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _invalid("peft_type", f"only LORA adapters are supported (got {peft_type!r})")
    if cfg.get("bias", "none") != "none":
        raise _invalid("bias", f"only 'none' is supported (got {cfg['bias']!r})")
    for name, why in _UNSUPPORTED.items():
        if cfg.get(name):
            raise _invalid(name, why)
    if cfg.get("init_lora_weights") == "mica":
        raise _invalid("init_lora_weights", "the MiCA variant is not supported")
    r = _positive_int(cfg.get("r", 8), "r")
    alpha = _positive_float(cfg.get("lora_alpha", 8), "lora_alpha")
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for name, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(pattern, dict):
            raise _invalid(name, f"must be an object of module pattern -> value (got {pattern!r})")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as e:
                raise _invalid(name, f"key {key!r} is not a valid regular expression: {e}") from None
    ranks = {k: _positive_int(v, f"rank_pattern[{k!r}]") for k, v in rank_pattern.items()}
    alphas = {k: _positive_float(v, f"alpha_pattern[{k!r}]") for k, v in alpha_pattern.items()}
    target_parameters = cfg.get("target_parameters") or ()
    if not isinstance(target_parameters, list | tuple) or not all(
        isinstance(t, str) and t for t in target_parameters
    ):
        raise _invalid("target_parameters", f"must be a list of parameter names (got {target_parameters!r})")
    if cfg.get("target_modules") in (None, [], ""):
        if not target_parameters:
            raise _invalid("target_modules", "must name at least one module")
        cfg = {**cfg, "target_modules": ()}  # experts only
    target = cfg["target_modules"]
    all_linear = isinstance(target, str) and target.lower() == "all-linear"
    if all_linear:
        target = ALL_MODULES
    exclude = cfg.get("exclude_modules")
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(n, int) for n in layers)):
        raise _invalid("layers_to_transform", f"must be an int or a list of ints (got {layers!r})")
    layers_pattern = cfg.get("layers_pattern")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    base = cfg.get("base_model_name_or_path")
    use_dora = cfg.get("use_dora") or False
    if not isinstance(use_dora, bool):
        raise _invalid("use_dora", f"must be true or false (got {use_dora!r})")
    if use_dora and target_parameters:
        raise _invalid("use_dora", "DoRA on the experts (target_parameters) is not supported")
    return AdapterSpec(
        r=r,
        lora_alpha=alpha,
        use_rslora=bool(cfg.get("use_rslora", False)),
        target_modules=_str_list_or_regex(target, "target_modules") if target else (),
        rank_pattern=ranks,
        alpha_pattern=alphas,
        exclude_modules=None if not exclude else _str_list_or_regex(exclude, "exclude_modules"),
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=tuple(layers_pattern) if layers_pattern else None,
        base_model_name_or_path=str(base) if base else None,
        all_linear=all_linear,
        target_parameters=tuple(target_parameters),
        use_dora=use_dora,
        trainable_tokens=parse_trainable_tokens(cfg.get("trainable_token_indices")),
    )


def _matches_target(spec: AdapterSpec, key: str) -> bool:
    """PEFT's `check_target_module_exists` for the options we accept."""
    ex = spec.exclude_modules
    if ex is not None:
        if isinstance(ex, str):
            if re.fullmatch(ex, key):
                return False
        elif key in ex or any(key.endswith(f".{e}") for e in ex):
            return False
    tm = spec.target_modules
    if isinstance(tm, str):
        return re.fullmatch(tm, key) is not None
    if key in tm:
        return True
    if not any(key.endswith(f".{t}") for t in tm):
        return False
    if spec.layers_to_transform is None:
        return True
    if spec.layers_pattern is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in spec.layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    return m is not None and int(m.group("idx")) in spec.layers_to_transform


def pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern key matching a suffix of the module path."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _moe_hint(hf_modules: tuple[str, ...]) -> str:
    # lora/shapes.py: a mixture-of-experts base offers attention modules, and its experts as parameters
    return (
        "; on this mixture-of-experts base target_modules may name attention projections, and "
        "target_parameters the experts (experts.gate_up_proj, experts.down_proj)"
        if hf_modules == ATTN_MODULES
        else ""
    )


def resolve_targets(
    spec: AdapterSpec, num_layers: int, hf_modules: tuple[str, ...] = ALL_MODULES
) -> dict[tuple[int, str], ModuleLoRA]:
    """Which (layer, module) the adapter targets, with PEFT's per-module rank/alpha/scaling.

    `hf_modules`: the model's targetable linears (`ModelShapes.hf_modules`); a targeted fused one
    (Phi-3's qkv_proj, gate_up_proj) comes back as its parts, each with the fused module's rank.
    Raises AdapterInvalid when a target is not a linear projection (or the embedding / lm_head,
    resolved by `resolve_embedding_targets`), or names nothing in this model architecture.
    """
    if spec.target_modules == ():  # an adapter of the experts only (target_parameters)
        return {}
    if spec.all_linear:  # PEFT resolves it against the model: Phi-3's linears are the fused ones
        spec = dataclasses.replace(spec, target_modules=tuple(hf_modules))
    projections = {module_path(n, m): (n, m) for n in range(num_layers) for m in hf_modules}
    paths = all_module_paths(num_layers, hf_modules)
    matched = [k for k in paths if k and _matches_target(spec, k)]
    for key in matched:
        if key in EMBEDDING_PATHS:  # lora/embedding_lora.py reads these
            continue
        if key not in projections:
            raise _invalid(
                "target_modules",
                f"targets {key!r}, which is not one of the linear projections {', '.join(hf_modules)}"
                f"{_moe_hint(hf_modules)}",
            )
    if not isinstance(spec.target_modules, str):
        for name in spec.target_modules:
            if not any(k == name or k.endswith(f".{name}") for k in paths):
                raise _invalid(
                    "target_modules",
                    f"{name!r} is not a module of this model architecture "
                    f"(LoRA can target {', '.join(hf_modules)}{_moe_hint(hf_modules)})",
                )
    if not matched:
        raise _invalid("target_modules", f"{spec.target_modules!r} matches no module of this model")
    out: dict[tuple[int, str], ModuleLoRA] = {}
    for key in matched:
        if key in EMBEDDING_PATHS:
            continue
        rank = pattern_value(spec.rank_pattern, key, spec.r)
        alpha = float(pattern_value(spec.alpha_pattern, key, spec.lora_alpha))
        layer, module = projections[key]
        for part in FUSED_MODULES.get(module, (module,)):
            out[(layer, part)] = ModuleLoRA(rank, alpha, spec.scaling(rank, alpha))
    return out


def resolve_embedding_targets(spec: AdapterSpec, num_layers: int) -> dict[str, ModuleLoRA]:
    """The embedding / lm_head targets ("model.embed_tokens", "lm_head") with PEFT's rank and scaling."""
    if spec.target_modules == ():
        return {}
    if spec.all_linear:  # PEFT's all-linear leaves the output layer out
        return {}
    out = {}
    for key in EMBEDDING_PATHS:
        if _matches_target(spec, key):
            rank = pattern_value(spec.rank_pattern, key, spec.r)
            alpha = float(pattern_value(spec.alpha_pattern, key, spec.lora_alpha))
            out[key] = ModuleLoRA(rank, alpha, spec.scaling(rank, alpha))
    return out


def check_fits(
    targets: dict[tuple[int, str], ModuleLoRA], max_lora_rank: int, lora_target_modules: Iterable[str]
) -> None:
    """Raise AdapterIncompatible when the adapter exceeds this server's LoRA limits. `targets` may
    hold expert targets too, keyed (layer, "experts.gate_up_proj") (lora/expert_targets.py)."""
    allowed = set(lora_target_modules)
    rank = max((t.rank for t in targets.values()), default=0)
    if rank > max_lora_rank:
        raise AdapterIncompatible(
            f"adapter_config.json: r: adapter rank {rank} exceeds this server's --max-lora-rank "
            f"{max_lora_rank}; restart with --max-lora-rank {rank} or more",
            field="r",
        )
    outside = sorted({m for _, m in targets} - allowed)
    if outside:
        raise AdapterIncompatible(
            f"adapter_config.json: targets {', '.join(outside)}, not in this server's "
            f"--lora-target-modules ({' '.join(sorted(allowed)) or 'none'}); restart with "
            "--lora-target-modules including them"
            + ("" if any(m.startswith("experts.") for m in outside) else ", or 'all'"),
            field="target_parameters" if outside[0].startswith("experts.") else "target_modules",
        )


def modules_of(targets: dict[tuple[int, str], ModuleLoRA]) -> list[str]:
    """The targeted module names, in the canonical q,k,v,o,gate,up,down order."""
    present = {m for _, m in targets}
    return [m for m in ALL_MODULES if m in present] + sorted(present - set(ALL_MODULES))
