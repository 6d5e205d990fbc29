"""Which FP8 scheme a model is served with: `--quantization fp8` and/or the checkpoint's own
`config.json` `quantization_config`; everything else is refused at start in one line.

Read formats (tensor names as the formats document them):
- compressed-tensors, format `float-quantized` (llm-compressor's FP8 / FP8-Dynamic checkpoints):
  `<linear>.weight` E4M3, `<linear>.weight_scale` (per tensor `[1]` or per channel `[out, 1]`),
  `<linear>.input_scale` when activations are static per tensor.
- `quant_method: fp8` (transformers' FP8 / DeepSeek style): with `weight_block_size` `[bn, bk]`,
  `<linear>.weight_scale_inv` `[ceil(out/bn), ceil(in/bk)]` (multiplied, despite the name), dynamic
  activations; without it, per-tensor `weight_scale` and optional static `input_scale`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.services.inference.models.config import UnsupportedModelError

QUANTIZATIONS = ("fp8",)  # what --quantization accepts
SUPPORTED = (
    "--quantization fp8 (quantize a bf16/fp16/fp32 checkpoint at load), compressed-tensors "
    "float-quantized (FP8 weights, per-tensor or per-channel scales), fp8 (per-tensor or weight_block_size)"
)
# Linears that may stay unquantized in a pre-quantized checkpoint: we never quantize these.
_IGNORABLE = ("lm_head",)


@dataclass(frozen=True)
class Fp8Scheme:
    """How the base model's q/k/v/o/gate/up/down weights are held: E4M3 with float32 scales."""

    name: str  # what the logs and GetModelInfo say
    prequantized: bool  # False: float weights are quantized per output channel at load
    block: tuple[int, int] | None = None  # (bn, bk) block-wise weight scales
    static_activations: bool = False  # the checkpoint's input_scale is used on the GPU path


def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what} is not supported; supported: {SUPPORTED}")


def read_quantization_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "config.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return raw.get("quantization_config") or raw.get("compression_config")


def _is_fp8_args(args: dict[str, Any] | None) -> bool:
    return args is not None and args.get("num_bits") == 8 and args.get("type") == "float"


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    static = set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _refuse(f"compressed-tensors format {fmt!r} (group {name})")
        weights, inputs = group.get("weights"), group.get("input_activations")
        if not _is_fp8_args(weights) or weights.get("strategy") not in ("tensor", "channel"):
            raise _refuse(f"compressed-tensors weights {weights} (group {name})")
        if not weights.get("symmetric", True) or weights.get("dynamic"):
            raise _refuse(f"compressed-tensors asymmetric or dynamic weights (group {name})")
        if inputs is not None:
            if not _is_fp8_args(inputs) or inputs.get("strategy") not in ("tensor", "token"):
                raise _refuse(f"compressed-tensors input_activations {inputs} (group {name})")
            static.add(not inputs.get("dynamic", False))
        if "Linear" not in (group.get("targets") or []):
            raise _refuse(f"compressed-tensors targets {group.get('targets')} (group {name})")
    if qc.get("kv_cache_scheme"):
        raise UnsupportedModelError(
            "the checkpoint's own KV cache scales (compressed-tensors kv_cache_scheme) are not supported: "
            "remove kv_cache_scheme from config.json and pass --kv-cache-dtype fp8 (per-layer scales 1.0)"
        )
    _check_ignore(qc.get("ignore") or [])
    return Fp8Scheme(
        "compressed-tensors float-quantized", prequantized=True, static_activations=True in static
    )


def _check_ignore(ignore: list[str]) -> None:
    odd = [m for m in ignore if not any(m.endswith(i) for i in _IGNORABLE)]
    if odd:
        raise UnsupportedModelError(
            f"the checkpoint leaves {odd[:3]} unquantized; loraplex serves FP8 checkpoints whose "
            "q/k/v/o/gate/up/down projections are all FP8 (only lm_head may stay unquantized)"
        )


def _fp8(qc: dict[str, Any]) -> Fp8Scheme:
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise _refuse(f"fp8 activation_scheme {act!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 fmt {qc.get('fmt')!r}")
    _check_ignore(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8 per-tensor", prequantized=True, static_activations=act == "static")
    if act != "dynamic" or len(block) != 2 or min(block) < 1:
        raise _refuse(f"fp8 weight_block_size {block} with activation_scheme {act!r}")
    return Fp8Scheme(
        f"fp8 block-wise {block[0]}x{block[1]}", prequantized=True, block=(int(block[0]), int(block[1]))
    )


def resolve_scheme(requested: str | None, quantization_config: dict[str, Any] | None) -> Fp8Scheme | None:
    """The scheme to serve with (None: unquantized), or UnsupportedModelError naming what works."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise _refuse(f"--quantization {requested!r}")
    if not quantization_config:
        return Fp8Scheme("fp8 (quantized at load)", prequantized=False) if requested else None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config)
    if method == "fp8":
        return _fp8(quantization_config)
    raise _refuse(f"this checkpoint's quantization ({method or 'unknown'!r})")
