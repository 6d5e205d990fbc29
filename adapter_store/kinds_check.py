"""The store's checks of adapter tensors beyond plain LoRA A/B pairs (the inference server reads the
same tensors: services/inference/lora/dora.py).

- DoRA (`use_dora: true`): one `lora_magnitude_vector` `[out]` per targeted module, beside its A/B
  pair; every value finite and positive (a zero or negative magnitude flips or kills a row).

`split_kind_tensors` takes these tensors out of the header's list before the A/B pairs are checked;
`check_kind_tensors` checks them against the pairs, and `check_kind_values` their values (one small
read each: magnitudes are a vector per module).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import LoraConfig
from loraplex.adapter_store.safetensors_header import SafetensorsHeader, TensorInfo

WEIGHTS_FILE = "adapter_model.safetensors"
MAGNITUDE_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_magnitude_vector(?:\.weight)?$")
_NUMPY = {"F32": "<f4", "F16": "<f2"}


def split_kind_tensors(tensors: tuple[TensorInfo, ...]) -> tuple[list[TensorInfo], dict[str, TensorInfo]]:
    """(the other tensors, DoRA magnitudes by module path)."""
    rest: list[TensorInfo] = []
    magnitudes: dict[str, TensorInfo] = {}
    for t in tensors:
        m = MAGNITUDE_RE.match(t.name)
        if m is None:
            rest.append(t)
        else:
            magnitudes[m["module"]] = t
    return rest, magnitudes


def check_kind_tensors(
    magnitudes: dict[str, TensorInfo], pairs: dict[str, dict[str, TensorInfo]], config: LoraConfig
) -> None:
    """Every magnitude belongs to a DoRA config and to a module with an A/B pair, `[out]` of its B;
    every module of a DoRA adapter has one."""
    for module, t in sorted(magnitudes.items()):
        where = f"{WEIGHTS_FILE}:{t.name}"
        if not config.use_dora:
            raise InvalidArgument(
                f"{where}: a DoRA magnitude, but adapter_config.json use_dora is not true",
                field=f"{WEIGHTS_FILE}:{t.name}",
            )
        if module not in pairs or "B" not in pairs[module]:
            raise InvalidArgument(f"{where}: no lora_A/lora_B pair for {module}", field=where)
        out_features = pairs[module]["B"].shape[0]
        if tuple(t.shape) != (out_features,):
            raise InvalidArgument(
                f"{where}: shape {list(t.shape)}, but {module}'s lora_B has {out_features} output rows",
                field=f"{where}.shape",
            )
    if config.use_dora:
        missing = sorted(m for m in pairs if m not in magnitudes)
        if missing:
            raise InvalidArgument(
                f"{WEIGHTS_FILE}: use_dora is true but {missing[0]} has no lora_magnitude_vector"
                + (f" (and {len(missing) - 1} more modules)" if len(missing) > 1 else ""),
                field=f"{WEIGHTS_FILE}:{missing[0]}.lora_magnitude_vector",
            )


def check_kind_values(path: Path, header: SafetensorsHeader, magnitudes: dict[str, TensorInfo]) -> None:
    """Every DoRA magnitude finite and positive."""
    with open(path, "rb") as f:
        for t in magnitudes.values():
            f.seek(header.data_start + t.begin)
            values = _as_float32(f.read(t.end - t.begin), t.dtype)
            bad = ~(np.isfinite(values) & (values > 0))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgument(
                    f"{WEIGHTS_FILE}:{t.name}: DoRA magnitudes must be finite and positive "
                    f"(row {i} is {float(values[i])!r})",
                    field=f"{WEIGHTS_FILE}:{t.name}.values",
                )


def _as_float32(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # the upper half of a float32
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=_NUMPY[dtype]).astype(np.float32)
