"""DoRA (`use_dora: true`): a learned magnitude per output row on top of the LoRA direction.

PEFT 0.21 (`peft/tuners/lora/dora.py`, `DoraLinearLayer`) computes, for a linear with base weight
`W [out, in]`, bias `b`, LoRA `A [r, in]`, `B [out, r]`, scaling `s` and magnitude `m [out]`:

    norm   = ||W + s * B @ A||_2 over each output row (dim=1), treated as a constant (detached)
    y      = (m / norm) * (W x + s * B A x) + b

The bias is added after the magnitude scale. `m / norm` depends on the weights only, so it is
computed once when the adapter is uploaded into a pool slot (`dora_factor`, on the pool's device,
in float32) and a step scales each DoRA row's `W x + delta` by it: the step never re-reads W.

Here: reading the magnitude tensors (`lora_magnitude_vector`, `[out]`; finite and positive) and
the factor. The pool holds the factors (lora/pool.py `DoraFactors`); the backends apply them
(lora/backend.py `LoRABackend.dora`, one launch per group: kernels/dora_scale.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.shapes import FUSED_MODULES, ModelShapes

if TYPE_CHECKING:
    from loraplex.services.inference.lora.adapter_weights import AdapterWeights

WEIGHTS_FILE = "adapter_model.safetensors"
MAGNITUDE_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_magnitude_vector(?:\.weight)?$")


def read_magnitude(f: Any, key: str, d_out: int, use_dora: bool) -> torch.Tensor:
    """The magnitude tensor `key` of the safetensors file `f` as float32 `[d_out]`, checked:
    the config must ask for DoRA, the shape must be the module's output width, every value
    finite and positive (a zero or negative magnitude has no meaning; it flips or kills a row)."""
    if not use_dora:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} is a DoRA magnitude but adapter_config.json use_dora is not true",
            field="use_dora",
        )
    shape = tuple(f.get_slice(key).get_shape())
    if shape != (d_out,):
        raise AdapterIncompatible(
            f"{WEIGHTS_FILE}: {key!r} has shape {shape}, this base model needs ({d_out},): "
            "the adapter was trained for another base model",
            field=WEIGHTS_FILE,
        )
    t = f.get_tensor(key).to(torch.float32)
    check_magnitude(key, t)
    return t


def check_magnitude(key: str, t: torch.Tensor) -> None:
    """AdapterInvalid unless every value of the magnitude `t` is finite and positive."""
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r}: DoRA magnitudes must be finite and positive "
            f"(row {i} is {float(t[i])!r})",
            field=WEIGHTS_FILE,
        )


def dora_factor(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, magnitude: torch.Tensor
) -> torch.Tensor:
    """`m / ||W + s * B @ A||` per output row, float32 `[out]` on `weight`'s device.

    `weight`: the base rows of this module `[out, in]` (any float dtype; dequantized for an FP8
    base). Computed in float32 in row chunks, so a wide projection never holds a second full copy."""
    device = weight.device
    a = lora_a.to(device, torch.float32)
    b = lora_b.to(device, torch.float32)
    norms = torch.empty(weight.shape[0], dtype=torch.float32, device=device)
    step = max(1, 2**24 // max(1, weight.shape[1]))  # about 64 MiB of float32 per chunk
    for lo in range(0, weight.shape[0], step):
        rows = weight[lo : lo + step].to(torch.float32) + scaling * (b[lo : lo + step] @ a)
        norms[lo : lo + step] = torch.linalg.norm(rows, dim=1)
    factor = magnitude.to(device, torch.float32) / norms
    if not bool(torch.isfinite(factor).all()):
        # A zero row of W + sBA: PEFT divides by zero too (its output is inf/nan); refuse instead.
        raise AdapterInvalid(
            "DoRA: a targeted row of the base weight plus the LoRA update has norm 0, so its "
            "magnitude scale is undefined",
            field=WEIGHTS_FILE,
        )
    return factor


def read_magnitudes(
    f: Any, key: str, target: tuple[int, str], shapes: ModelShapes, use_dora: bool, out: dict
) -> None:
    """A DoRA magnitude `[out]` of (layer, HF module), split into its parts' rows for a fused module."""
    layer, module = target
    parts = FUSED_MODULES.get(module, (module,))
    widths = [shapes.module_dims(p)[1] for p in parts]
    t = read_magnitude(f, key, sum(widths), use_dora)
    for part, piece in zip(parts, t.split(widths), strict=True):
        out[(layer, part)] = piece.contiguous()


# (layer, module) -> that projection's base rows `[out, in]` on the device (LlamaForCausalLM.lora_base_weight)
BaseWeight = Callable[[int, str], torch.Tensor]

TP_REFUSAL = (
    "adapter_config.json: use_dora: DoRA adapters are not served under tensor parallelism "
    "(--tp-size > 1): each rank holds part of a row's weights, and the per-row norms need all of them"
)


def fill_factors(weights: AdapterWeights, base_weight: BaseWeight | None) -> None:
    """Compute `weights.dora_factor` (host float32 `[out]` per target) once, for a DoRA adapter.

    AdapterIncompatible where the server has no base weights to hand (tensor parallelism)."""
    if not weights.spec.use_dora or weights.dora_factor:
        return
    if base_weight is None:
        raise AdapterIncompatible(TP_REFUSAL, field="use_dora")
    factors = {}
    with torch.no_grad():
        for key, target in weights.targets.items():
            w = base_weight(*key)
            f = dora_factor(
                w, weights.lora_a[key], weights.lora_b[key], target.scaling, weights.dora_magnitude[key]
            )
            factors[key] = f.cpu()
    weights.dora_factor.update(factors)
