"""FP8 checkpoints written from a float one, in the formats people download, and the float32
reference built from each one's own dequantized weights.

Tensor names and config keys follow the formats' documentation: compressed-tensors
`float-quantized` (`weight` E4M3, `weight_scale` `[1]` per tensor or `[out, 1]` per channel,
`input_scale` for static activations) and transformers' block-wise `fp8` (`weight` E4M3,
`weight_scale_inv` `[ceil(out/bn), ceil(in/bk)]`, multiplied). The quantizer here is the test's
own (round to nearest, scale = amax / 448), independent of the engine's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("ct-channel", "ct-tensor-static", "fp8-block")
BLOCK = (16, 48)  # rows divide the tiny model's projections; 48 leaves a partial block on K = 64, 128


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _q(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def _block_scale(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    grid = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
    return grid.clamp(min=1e-12)


def _expand(grid: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    return grid.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def quantization_config(fmt: str, block: tuple[int, int] = BLOCK) -> dict:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
        }
    static = fmt == "ct-tensor-static"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "tensor" if static else "channel",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "dynamic": not static,
                    "strategy": "tensor" if static else "token",
                },
            }
        },
    }


def write_fp8_checkpoint(src: Path, out: Path, fmt: str, block: tuple[int, int] = BLOCK) -> Path:
    """`src`'s float checkpoint with every decoder linear in FP8, in format `fmt` (FORMATS)."""
    tensors = load_file(str(src / "model.safetensors"))
    result: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if not _is_linear(name):
            result[name] = t
            continue
        w = t.float()
        stem = name[: -len(".weight")]
        if fmt == "fp8-block":
            grid = _block_scale(w, block)
            result[name] = _q(w, _expand(grid, w.shape, block))
            result[stem + ".weight_scale_inv"] = grid
        elif fmt == "ct-channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
            result[name] = _q(w, scale)
            result[stem + ".weight_scale"] = scale
        elif fmt == "ct-tensor-static":
            scale = (w.abs().max() / 448).reshape(1)
            result[name] = _q(w, scale)
            result[stem + ".weight_scale"] = scale
            result[stem + ".input_scale"] = (torch.rand(1, generator=gen) + 0.5) / 448 * 4
        else:
            raise ValueError(fmt)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, block)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dequantize_checkpoint(src: Path, out: Path) -> Path:
    """The float32 checkpoint holding `src`'s FP8 weights times their scales (no quantization_config):
    the reference an FP8 checkpoint must match. A float source is first quantized per output
    channel, as `--quantization fp8` does at load."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config", None)
    block = tuple(qc["weight_block_size"]) if qc and qc.get("weight_block_size") else None
    result = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if not _is_linear(name):
            result[name] = t.float()
            continue
        stem = name[: -len(".weight")]
        if qc is None:  # --quantization fp8's scheme
            scale = (t.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
            result[name] = _q(t.float(), scale).float() * scale
        elif block is not None:
            result[name] = t.float() * _expand(tensors[stem + ".weight_scale_inv"], t.shape, block)
        else:
            result[name] = t.float() * tensors[stem + ".weight_scale"].reshape(-1, 1)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
