"""Which GEMM serves an FP8 linear for a batch: `LORAPLEX_FP8_GEMM` (kernels/settings.py), and under
`auto` (the default) the per-shape choice of kernels/fp8_gemm_configs.py where one was measured, else a
rule by the weight's shape.

The kernels: `weight_only` and `w8a8` (kernels/fp8_weight_gemm.py, Triton), `scaled_mm`
(`torch._scaled_mm`, kernels/fp8_matmul.py), and `ref` (the dequantizing torch path: the CPU, or a
GPU without FP8 tensor cores).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from loraplex.kernels.fp8_gemm_configs import auto_choice
from loraplex.kernels.fp8_weight_gemm import supports
from loraplex.kernels.placement import triton_runs_on
from loraplex.kernels.settings import kernel_settings

# The rule where no choice was measured: the W8A8 GEMM up to W8A8_MAX_ROWS rows, torch._scaled_mm above
# (per Llama-3.1-8B projection, 2026-12-06, bench/fp8_gemm.py: the W8A8 GEMM fastest of the three at
# 1-64 rows on q/k/v, o, gate/up and down, 0.54-0.82x bf16 on an H100 and 0.57-0.94x on an H200; with
# tiles of its own at 128 and 256 rows it beat torch._scaled_mm on the H200 at 128-256 rows on o and
# down and at 128-192 on q/k/v, 0.69-0.95x its time; the exceptions are built-in `auto` entries in
# kernels/fp8_gemm_configs.py; docs/benchmarks.md).
W8A8_MAX_ROWS = 256


@lru_cache(maxsize=8)
def _has_fp8_hardware(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm_kernel(
    x: torch.Tensor,
    block: tuple[int, int] | None,
    scaled_mm_ready: bool,
    weight_shape: tuple[int, int] | None = None,
) -> str:
    """The GEMM for `x` times an FP8 weight of `weight_shape` `[N, K]` (None: any) with these scales:
    `scaled_mm` where the weight has `torch._scaled_mm` operands (`scaled_mm_ready`) and the setting
    says so or Triton cannot serve x, else `ref` there; the Triton GEMMs only where Triton serves x
    (CUDA with FP8 conversions, sm 8.9+, in bf16/fp16; CPU tensors under the interpreter, for the
    tests). `weight_only` / `w8a8` force their kernel; `auto` takes the weight-only GEMM where the
    weight has no `torch._scaled_mm` operands, else the measured choice for this (rows bucket, N, K)
    (kernels/fp8_gemm_configs.py), else the rule above."""
    fallback = "scaled_mm" if scaled_mm_ready else "ref"
    mode = kernel_settings().fp8_gemm
    if mode == "scaled_mm" or not triton_runs_on(x) or not supports(block):
        return fallback
    if x.is_cuda and (x.dtype not in (torch.bfloat16, torch.float16) or not _has_fp8_hardware(x.device)):
        return fallback
    if mode != "auto":
        return mode
    if not scaled_mm_ready:
        return "weight_only"
    rows = x.numel() // x.shape[-1]
    measured = auto_choice(rows, *weight_shape) if weight_shape is not None else None
    if measured is not None:
        return measured
    return "w8a8" if rows <= W8A8_MAX_ROWS else "scaled_mm"


def keeps_block_scales(block: tuple[int, int] | None) -> bool:
    """Whether a block-scaled checkpoint is served with its own scales on the GPU (the weight-only GEMM
    for every batch, `LORAPLEX_FP8_GEMM=weight_only`) rather than re-quantized per output channel at
    load for `torch._scaled_mm` or the W8A8 GEMM (`scaled_mm`, `w8a8`, and `auto`, which picks among
    them per shape)."""
    return block is not None and kernel_settings().fp8_gemm == "weight_only" and supports(block)
