"""FP8 (E4M3) linear: the hardware matmul and the dequantizing torch reference beside it.

Weights are `float8_e4m3fn` `[N, K]` with float32 scales of one of two layouts:
per output channel (`[N, 1]`: the quantize-at-load path, compressed-tensors per-channel, and
per-tensor scales broadcast to rows) or per `(bn, bk)` block (`[ceil(N/bn), ceil(K/bk)]`, the
block-wise `fp8` checkpoint format). The real value of an element is `fp8 * scale`.

`fp8_linear_ref` dequantizes the weight to the activation dtype and runs an ordinary matmul
(activations not quantized): the CPU path, and what the tests hold the model to. `fp8_linear_mm`
quantizes activations per token (or with a static per-tensor input scale) and calls
`torch._scaled_mm` with row-wise scales (cuBLASLt on Hopper/Ada).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_rows_fused
from loraplex.kernels.placement import triton_runs_on


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric E4M3 quantization, round to nearest: (fp8 `[R, C]`, float32 scale `[R, 1]`)
    with scale = amax / 448 (what the published FP8 checkpoints use)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 scale of every element of an `[N, K]` weight."""
    n, k = shape
    if block is None:
        return scale.reshape(-1, 1).expand(n, k)
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """The weight's real values in `dtype` (the product formed in float32, then rounded once)."""
    return (weight.float() * expand_scale(scale, tuple(weight.shape), block)).to(dtype)


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `x @ dequantize(weight).T + bias` in x's dtype; x is not quantized."""
    return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `fp8_linear_mm` can run these operands: a CUDA device with FP8 tensor cores (sm 8.9+)
    and the 16-element alignment cuBLASLt's FP8 GEMM needs on K and N."""
    if not x.is_cuda:
        return False
    major, minor = torch.cuda.get_device_capability(x.device)
    n, k = weight.shape
    return (major, minor) >= (8, 9) and k % 16 == 0 and n % 16 == 0


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, K]` activations to E4M3 with a float32 `[M, 1]` scale: per token (dynamic), or the
    checkpoint's static per-tensor `input_scale` repeated per row."""
    if input_scale is None:
        return quantize_rows_fused(x) if triton_runs_on(x) else quantize_rows(x)
    scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_row: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hardware FP8 GEMM with row-wise scales: `scale_row` is the weight's per-channel scale as
    a contiguous float32 `[1, N]`. Output in x's dtype (bf16 from the GEMM, cast if x is not)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    xq, xs = quantize_activations(x2, input_scale)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_row, bias=None, out_dtype=torch.bfloat16)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
