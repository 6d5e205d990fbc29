"""Validate an adapter (config + safetensors) before anything is cached or indexed.

The header is checked first (no data loaded), then the tensors against the LoRA config and
the base model's shapes, then one sequential pass hashes the file and checks every value is
finite. Each failure is InvalidArgument naming the file, tensor and field.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.expert_check import check_expert_module, is_expert_module
from loraplex.adapter_store.kinds_check import (
    check_kind_tensors,
    check_kind_values,
    check_vocab_tensors,
    split_kind_tensors,
    split_vocab_tensors,
)
from loraplex.adapter_store.lora_config import LoraConfig
from loraplex.adapter_store.safetensors_header import SafetensorsHeader, TensorInfo, read_header

WEIGHTS_FILE = "adapter_model.safetensors"
TENSOR_NAME_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
ANY_LAYER_RE = re.compile(r"(?:^|\.)layers\.([^.]*)\.")
# The module tree the inference server serves (Llama, Mistral, Qwen2); with --base-model every
# LoRA tensor must sit on one of these paths, as the inference server requires.
MODULE_GROUP = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "qkv_proj": "self_attn",  # Phi-3's fused modules
    "gate_up_proj": "mlp",
}
HASH_CHUNK = 8 * 2**20
# Exponent-all-ones masks: a value is NaN or Inf exactly when (bits & mask) == mask.
_NONFINITE = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}
# The largest magnitude a LoRA weight may have: float16's largest value (the inference server's
# bound, services/inference/lora/tensor_checks.py). Past it a value is no trained LoRA weight and
# overflows a float16 pool to Inf. Per dtype: (sign-clearing mask, bits of the largest value allowed);
# NaN and Inf are past it too, so one comparison finds both kinds of bad value.
MAX_WEIGHT_ABS = 65504.0
_MAGNITUDE = {"F32": (0x7FFFFFFF, 0x477FE000), "F16": (0x7FFF, 0x7BFF), "BF16": (0x7FFF, 0x477F)}


class AdapterSummary(NamedTuple):
    digest: str
    size_bytes: int
    dtype: str
    rank: int
    num_tensors: int


def validate_adapter(
    config: LoraConfig, weights: Path, base: BaseModelShapes | None = None
) -> AdapterSummary:
    """Check `weights` against `config` (and `base`); return its digest and summary."""
    header = read_header(weights, WEIGHTS_FILE)
    dtype, rank = check_tensors(header, config, base)
    digest = hash_and_check_finite(weights, header)
    check_kind_values(weights, header, split_kind_tensors(header.tensors)[1])
    return AdapterSummary(digest, header.file_size, dtype, rank, len(header.tensors))


def check_tensors(
    header: SafetensorsHeader, config: LoraConfig, base: BaseModelShapes | None
) -> tuple[str, int]:
    """Return (dtype, max rank) after checking names, pairing, shapes, ranks and base dims."""
    if not header.tensors:
        raise InvalidArgument(f"{WEIGHTS_FILE}: contains no tensors", field=WEIGHTS_FILE)
    pairs: dict[str, dict[str, TensorInfo]] = {}
    dtypes = set()
    tensors, magnitudes = split_kind_tensors(header.tensors)  # DoRA's, checked after the pairs
    tensors, vocab = split_vocab_tensors(tensors)  # embed_tokens / lm_head LoRA
    for t in tensors:
        where = f"{WEIGHTS_FILE}:{t.name}"
        m = TENSOR_NAME_RE.match(t.name)
        if m is None:
            raise InvalidArgument(
                f"{where}: not a PEFT LoRA tensor name (expected base_model.model.<module>.lora_A.weight "
                "or .lora_B.weight)",
                field=where,
            )
        if len(t.shape) != 2 or 0 in t.shape:
            raise InvalidArgument(
                f"{where}: shape {list(t.shape)} is not a non-empty matrix", field=f"{where}.shape"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = t
        dtypes.add(t.dtype)
    if len(dtypes) > 1:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}: mixed dtypes {sorted(dtypes)}; use one", field=f"{WEIGHTS_FILE}:dtype"
        )
    max_rank = 0
    for module, ab in sorted(pairs.items()):
        max_rank = max(max_rank, _check_module(module, ab, config, base))
    check_kind_tensors(magnitudes, pairs, config)
    max_rank = max(max_rank, check_vocab_tensors(vocab, config, base))
    return (dtypes.pop() if dtypes else vocab[0].dtype), max_rank


def _check_module(
    module: str, ab: dict[str, TensorInfo], config: LoraConfig, base: BaseModelShapes | None
) -> int:
    for side in "AB":
        if side not in ab:
            other = ab["B" if side == "A" else "A"]
            raise InvalidArgument(
                f"{WEIGHTS_FILE}:{other.name}: has no matching lora_{side} tensor",
                field=f"{WEIGHTS_FILE}:{other.name}",
            )
    a, b = ab["A"], ab["B"]
    if is_expert_module(module):  # LoRA on the experts of a mixture-of-experts base (target_parameters)
        return check_expert_module(module, a, b, config, base)
    if not config.targets(module):
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: module {module} is not in target_modules {config.target_modules!r}",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    _check_layer_index(module, a)
    rank = config.rank_for(module)
    (a_rank, in_features), (out_features, b_rank) = a.shape, b.shape
    if a_rank != rank:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: shape {list(a.shape)} has rank {a_rank}, but adapter_config.json "
            f"gives {module} rank {rank} (r / rank_pattern)",
            field=f"{WEIGHTS_FILE}:{a.name}.shape",
        )
    if b_rank != rank:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{b.name}: shape {list(b.shape)} has rank {b_rank}, but adapter_config.json "
            f"gives {module} rank {rank} (r / rank_pattern)",
            field=f"{WEIGHTS_FILE}:{b.name}.shape",
        )
    if base is not None:
        _check_against_base(module, a, b, in_features, out_features, base)
    return rank


def _check_layer_index(module: str, a: TensorInfo) -> None:
    for index in ANY_LAYER_RE.findall(module):
        if not index.isdecimal() or str(int(index)) != index:
            raise InvalidArgument(
                f"{WEIGHTS_FILE}:{a.name}: layer index {index[:20]!r} is not a non-negative integer",
                field=f"{WEIGHTS_FILE}:{a.name}",
            )


def _check_against_base(
    module: str, a: TensorInfo, b: TensorInfo, in_features: int, out_features: int, base: BaseModelShapes
) -> None:
    suffix = module.rsplit(".", 1)[-1]
    layer = LAYER_RE.search(module)
    if (
        suffix not in MODULE_GROUP
        or layer is None
        or module != f"model.layers.{layer.group(1)}.{MODULE_GROUP[suffix]}.{suffix}"
    ):
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: {module} is not a LoRA-targetable projection of base model "
            f"{base.name} (model.layers.N.{{self_attn,mlp}}.{{{','.join(MODULE_GROUP)}}})",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    if layer is not None and int(layer.group(1)) >= base.num_layers:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: layer {layer.group(1)} does not exist in base model {base.name} "
            f"({base.num_layers} layers)",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    expected = base.expected(suffix)
    if expected is None:  # e.g. q_proj of a Phi-3 base, whose q/k/v are one qkv_proj
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: base model {base.name} has no {suffix} (its projections: "
            f"{', '.join(m for m in base.linears if m in MODULE_GROUP)})",
            field=f"{WEIGHTS_FILE}:{a.name}",
        )
    if in_features != expected[0]:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{a.name}: in_features {in_features} != {expected[0]} of {module} in base model "
            f"{base.name}",
            field=f"{WEIGHTS_FILE}:{a.name}.shape",
        )
    if out_features != expected[1]:
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{b.name}: out_features {out_features} != {expected[1]} of {module} in base "
            f"model {base.name}",
            field=f"{WEIGHTS_FILE}:{b.name}.shape",
        )


def hash_and_check_finite(path: Path, header: SafetensorsHeader) -> str:
    """One sequential read: sha256 of the whole file, and NaN, Inf and values past MAX_WEIGHT_ABS
    refused tensor by tensor."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(header.data_start))
        for t in header.tensors:
            uint, mask = _NONFINITE[t.dtype]
            item = np.dtype(uint).itemsize
            remaining = t.end - t.begin
            chunk = HASH_CHUNK - HASH_CHUNK % item
            while remaining:
                data = f.read(min(chunk, remaining))
                if not data:
                    raise InvalidArgument(f"{WEIGHTS_FILE}: file shrank while reading", field=WEIGHTS_FILE)
                remaining -= len(data)
                h.update(data)
                check_weight_values(t, np.frombuffer(data, dtype=uint), mask)
    return "sha256:" + h.hexdigest()


def check_weight_values(t: TensorInfo, bits: np.ndarray, nonfinite_mask: int) -> None:
    """Refuse a NaN, an Inf, or a value of magnitude past MAX_WEIGHT_ABS among `bits` (`t`'s raw values)."""
    abs_mask, limit = _MAGNITUDE[t.dtype]
    if not np.any((bits & abs_mask) > limit):
        return
    if np.any((bits & nonfinite_mask) == nonfinite_mask):
        raise InvalidArgument(
            f"{WEIGHTS_FILE}:{t.name}: contains NaN or Inf values", field=f"{WEIGHTS_FILE}:{t.name}.values"
        )
    raise InvalidArgument(
        f"{WEIGHTS_FILE}:{t.name}: holds a value of magnitude past {MAX_WEIGHT_ABS:g}, the most any LoRA "
        "weight may have (float16's range)",
        field=f"{WEIGHTS_FILE}:{t.name}.values",
    )
