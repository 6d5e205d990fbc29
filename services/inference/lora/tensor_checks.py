"""The checks every adapter tensor passes before it reaches the pool, whatever path loaded it.

The adapter store checks the same before it keeps an adapter (adapter_store/validate.py), but a
server without a store reads directories itself (`LoadAdapter` with a path, `--lora-paths`), so the
load path checks too: the two services share only the protos, so each holds its own copy of the rule.

- dtype: F16, BF16 or F32, read from the header before any data (a float64 or int8 tensor is not a
  PEFT LoRA weight, and an integer tensor would be served as its raw values);
- values: finite, and of magnitude at most MAX_WEIGHT_ABS. A NaN or Inf weight makes every output
  of its requests NaN; a weight past float16's range is no trained LoRA weight and overflows a
  float16 pool to Inf. The bound is float16's largest value, so any F16 file passes it.
"""

from __future__ import annotations

import torch

from loraplex.services.inference.errors import AdapterInvalid

WEIGHTS_FILE = "adapter_model.safetensors"
# safetensors' dtype names (the header's) of the element types an adapter may hold.
ALLOWED_DTYPES = ("F16", "BF16", "F32")
# float16's largest finite value: the most any LoRA weight may be, in magnitude.
MAX_WEIGHT_ABS = 65504.0


def check_weight_dtype(key: str, dtype: str) -> None:
    """AdapterInvalid unless the header's `dtype` of tensor `key` is one an adapter may hold."""
    if dtype not in ALLOWED_DTYPES:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} has dtype {dtype}; adapter weights must be one of "
            f"{', '.join(ALLOWED_DTYPES)}",
            field=f"{WEIGHTS_FILE}:{key}.dtype",
        )


def check_weight_values(key: str, t: torch.Tensor) -> None:
    """AdapterInvalid if tensor `key` holds a NaN, an Inf or a value past MAX_WEIGHT_ABS."""
    if t.numel() == 0:
        return
    peak = t.detach().abs().amax().float()  # NaN where any value is NaN
    if not bool(torch.isfinite(peak)):
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} contains NaN or Inf values", field=f"{WEIGHTS_FILE}:{key}.values"
        )
    if float(peak) > MAX_WEIGHT_ABS:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} holds a value of magnitude {float(peak):.3g}, past the "
            f"{MAX_WEIGHT_ABS:g} any LoRA weight may have (float16's range)",
            field=f"{WEIGHTS_FILE}:{key}.values",
        )


def read_checked(f, key: str) -> torch.Tensor:
    """Tensor `key` of the open safetensors file `f`, its dtype checked before its data is read and
    its values after."""
    check_weight_dtype(key, f.get_slice(key).get_dtype())
    t = f.get_tensor(key)
    check_weight_values(key, t)
    return t
