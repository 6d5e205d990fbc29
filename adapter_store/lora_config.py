"""Parse and check `adapter_config.json` as a PEFT LoRA config."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import NamedTuple

from loraplex.adapter_store.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 1 * 2**20
# The largest lora_alpha (and alpha_pattern value) kept: float16's largest value, as the inference
# server's. Real adapters use alphas of 1 to a few thousand; 1e30 is finite in the server's float32
# scaling table but scales every delta past any activation's range (Inf, then NaN logits).
MAX_ALPHA = 65504.0
# PEFT features that change the forward beyond B(A(x)) * scaling. The inference server refuses
# the same list (services/inference/lora/config.py); the store must not record what it refuses.
UNSUPPORTED = {
    "lora_bias": "LoRA bias terms are not supported (only plain LoRA A/B weights)",
    "modules_to_save": "modules_to_save (full module copies) are not supported",
    "fan_in_fan_out": "fan_in_fan_out is for Conv1D (GPT-2 style) layers; these models use nn.Linear",
    "layer_replication": "layer_replication is not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "BD-LoRA is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "KaSA is not supported",
    "velora_config": "VeLoRA is not supported",
    "monteclora_config": "MonteCLoRA is not supported",
}


class LoraConfig(NamedTuple):
    r: int
    lora_alpha: float
    # A list of module-name suffixes, or one regex matched against the full module name (PEFT's rules).
    target_modules: tuple[str, ...] | str
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model: str
    text: str
    digest: str
    # PEFT's LoRA on raw parameters: the stacked experts of Mixtral / Qwen3-MoE (expert_check.py)
    target_parameters: tuple[str, ...] = ()
    # DoRA: a lora_magnitude_vector per targeted module (kinds_check.py)
    use_dora: bool = False
    # trainable_token_indices: {"model.embed_tokens" / "lm_head": token ids} (kinds_check.py)
    trainable_tokens: dict[str, tuple[int, ...]] = {}

    def rank_for(self, module: str) -> int:
        """The rank PEFT gives `module` (e.g. `model.layers.0.self_attn.q_proj`)."""
        key = _pattern_key(self.rank_pattern, module)
        return self.rank_pattern[key] if key is not None else self.r

    def targets(self, module: str) -> bool:
        """Whether PEFT would have put a LoRA on `module`."""
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == "all-linear":  # every linear; the base check names them
                return True
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def target_module_names(self) -> list[str]:
        if isinstance(self.target_modules, str):
            return [self.target_modules]
        # the experts a target_parameters adapter reaches are listed beside its modules
        return list(self.target_modules) + [t for t in self.target_parameters if t not in self.target_modules]


def _pattern_key(pattern: dict, module: str) -> str | None:
    # PEFT's get_pattern_key: the first key whose regex matches a dotted suffix of the name.
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _bad(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{CONFIG_FILE}: {message}", field=f"{CONFIG_FILE}:{field}")


def parse_lora_config(raw: bytes) -> LoraConfig:
    """Parse `raw` (the file's bytes) as a LoRA config this project can serve; raise InvalidArgument
    if it is not one."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise _bad("size", f"{len(raw)} bytes exceeds the {MAX_CONFIG_BYTES}-byte cap")
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:  # its message would echo the file's bytes
        raise _bad("json", f"not valid JSON: not UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise _bad("json", f"not valid JSON: {e}") from None
    except RecursionError:
        raise _bad("json", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise _bad("json", "not a JSON object")
    peft_type = str(data.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise _bad("peft_type", f"peft_type is {data.get('peft_type')!r}, not 'LORA'")
    r = data.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _bad("r", f"r must be a positive integer, got {r!r}")
    alpha = data.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= MAX_ALPHA:
        raise _bad(
            "lora_alpha", f"lora_alpha must be a positive number of at most {MAX_ALPHA:g}, got {alpha!r}"
        )
    target_parameters = data.get("target_parameters") or []
    if not isinstance(target_parameters, list) or not all(
        isinstance(t, str) and t for t in target_parameters
    ):
        raise _bad(
            "target_parameters", f"target_parameters must be a list of names, got {target_parameters!r}"
        )
    targets = data.get("target_modules")
    if targets in (None, [], "") and target_parameters:
        targets = ()  # an adapter of the experts only
    elif isinstance(targets, str) and targets:
        try:
            re.compile(targets)
        except re.error as e:
            raise _bad("target_modules", f"target_modules regex {targets!r} does not compile: {e}") from None
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        targets = tuple(targets)
    else:
        raise _bad(
            "target_modules", f"target_modules must be a non-empty list of names or a regex, got {targets!r}"
        )
    for key, why in UNSUPPORTED.items():
        if data.get(key):
            raise _bad(key, why)
    if data.get("bias", "none") != "none":
        raise _bad("bias", f"only bias 'none' is supported, got {data.get('bias')!r}")
    if data.get("init_lora_weights") == "mica":
        raise _bad("init_lora_weights", "the MiCA variant is not supported")
    use_dora = data.get("use_dora") or False
    if not isinstance(use_dora, bool):
        raise _bad("use_dora", f"use_dora must be true or false, got {use_dora!r}")
    if use_dora and target_parameters:
        raise _bad("use_dora", "DoRA on the experts (target_parameters) is not supported")
    trainable_tokens = _trainable_tokens(data.get("trainable_token_indices"))
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _bad("use_rslora", f"use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = _positive_map(data.get("rank_pattern") or {}, "rank_pattern", integer=True)
    alpha_pattern = _positive_map(data.get("alpha_pattern") or {}, "alpha_pattern", integer=False)
    return LoraConfig(
        r=r,
        lora_alpha=float(alpha),
        target_modules=targets,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        base_model=str(data.get("base_model_name_or_path") or ""),
        text=text,
        digest="sha256:" + hashlib.sha256(raw).hexdigest(),
        target_parameters=tuple(target_parameters),
        use_dora=use_dora,
        trainable_tokens=trainable_tokens,
    )


_TOKEN_LAYERS = {
    "embed_tokens": "model.embed_tokens",
    "model.embed_tokens": "model.embed_tokens",
    "lm_head": "lm_head",
}


def _trainable_tokens(value: object) -> dict[str, tuple[int, ...]]:
    """PEFT's trainable_token_indices: a list of ids (the embedding's) or an object layer -> ids."""
    if value is None or value == [] or value == {}:
        return {}
    layers = {"embed_tokens": value} if isinstance(value, list) else value
    if not isinstance(layers, dict):
        raise _bad("trainable_token_indices", f"must be a list of token ids or an object, got {value!r}")
    out = {}
    for name, ids in layers.items():
        if name not in _TOKEN_LAYERS:
            raise _bad(
                "trainable_token_indices", f"layer {name!r}: only embed_tokens and lm_head rows are served"
            )
        ok = (
            isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        )
        if not ok or min(ids) < 0 or len(set(ids)) != len(ids):
            raise _bad(
                "trainable_token_indices",
                f"{name}: must be a non-empty list of distinct non-negative token ids, got {ids!r}",
            )
        out[_TOKEN_LAYERS[name]] = tuple(ids)
    return out


def _positive_map(value: object, field: str, *, integer: bool) -> dict:
    if not isinstance(value, dict):
        raise _bad(field, f"{field} must be an object, got {value!r}")
    for key, v in value.items():
        ok = isinstance(v, int) if integer else isinstance(v, int | float)
        if isinstance(v, bool) or not ok or not 0 < v < math.inf or (not integer and v > MAX_ALPHA):
            raise _bad(
                f"{field}.{key}",
                f"{field}[{key!r}] must be a positive "
                + ("integer" if integer else f"number of at most {MAX_ALPHA:g}"),
            )
        try:
            re.compile(key)
        except re.error as e:
            raise _bad(f"{field}.{key}", f"{field} key {key!r} is not a valid pattern: {e}") from None
    return dict(value)
