"""Range checks of config.json's numbers, before anything is sized or computed from them.

A value out of range would otherwise surface late and far from its cause: `max_position_embeddings: 0`
as a traceback in warm-up, `vocab_size: 2**31` as a 512 GiB allocation, a negative `sliding_window`
as NaN attention. Each refusal is one line naming the key (UnsupportedModelError, which the server
logs as one line at start).

The upper bounds are sanity bounds, several times the largest open models' values (vocabularies
reach 262,144 (Gemma 3), hidden sizes 16,384, intermediate sizes 53,248 (Llama 3.1 405B)): they
refuse a typo or a hostile file before it sizes an allocation, never a real model.
"""

from __future__ import annotations

import math
from typing import Any

from loraplex.services.inference.models.errors import UnsupportedModelError

MAX_VOCAB_SIZE = 1 << 22  # 4,194,304
MAX_WIDTH = 1 << 18  # hidden, intermediate and expert widths: 262,144
MAX_HEADS = 4096  # attention heads, KV heads, head_dim, layers, experts
# key -> (required, upper bound): a positive integer, at most the bound.
POSITIVE_INTS: dict[str, tuple[bool, int | None]] = {
    "vocab_size": (True, MAX_VOCAB_SIZE),
    "hidden_size": (True, MAX_WIDTH),
    "intermediate_size": (False, MAX_WIDTH),
    "moe_intermediate_size": (False, MAX_WIDTH),
    "num_hidden_layers": (True, MAX_HEADS),
    "num_attention_heads": (True, MAX_HEADS),
    "num_key_value_heads": (False, MAX_HEADS),
    "head_dim": (False, MAX_HEADS),
    "num_local_experts": (False, MAX_HEADS),
    "num_experts_per_tok": (False, MAX_HEADS),
    "max_position_embeddings": (False, None),
    "original_max_position_embeddings": (False, None),
}
# key -> whether 0 is allowed: finite positive numbers (non-negative where 0 is meaningful).
FINITE_NUMBERS: dict[str, bool] = {
    "rms_norm_eps": True,
    "rope_theta": False,
    "rope_local_base_freq": False,
    "query_pre_attn_scalar": False,
}


def _refuse(key: str, want: str, value: Any) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {key} must be {want} (got {value!r:.60})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config_ranges(raw: dict[str, Any]) -> None:
    """Refuse the first out-of-range value of `raw` (a config.json dict), naming its key. A key that
    may be absent is checked only where present and not null."""
    for key, (required, bound) in POSITIVE_INTS.items():
        value = raw.get(key)
        if value is None and not required:
            continue
        if not _is_int(value) or value < 1 or (bound is not None and value > bound):
            want = "a positive integer" + (f" of at most {bound:,}" if bound is not None else "")
            raise _refuse(key, want, value)
    window = raw.get("sliding_window")
    if window is not None and (not _is_int(window) or window < 0):
        raise _refuse("sliding_window", "a positive integer (0 or null: no window)", window)
    for key, zero_ok in FINITE_NUMBERS.items():
        value = raw.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise _refuse(
                key, "a finite number of at least 0" if zero_ok else "a finite positive number", value
            )
    _check_rope_numbers(raw)


def _check_rope_numbers(raw: dict[str, Any]) -> None:
    """rope_scaling's / rope_parameters' factor and theta (one dict, or one per layer type: Gemma 3)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if not isinstance(params, dict):
            continue
        entries = [(key, params)] + [(f"{key}.{k}", v) for k, v in params.items() if isinstance(v, dict)]
        for where, entry in entries:
            for name in ("factor", "rope_theta"):
                value = entry.get(name)
                if value is None:
                    continue
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if not number or not math.isfinite(value) or value <= 0:
                    raise _refuse(f"{where}.{name}", "a finite positive number", value)
