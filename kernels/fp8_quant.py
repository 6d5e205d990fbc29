"""Per-token FP8 activation quantization in one launch (the torch reference: fp8_matmul.quantize_rows).

Under TRITON_INTERPRET=1 the cast to E4M3 does not round to nearest (as bf16 arithmetic is wrong
there), so the CPU tests feed it values that land on the E4M3 grid.

Why: the FP8 GEMM needs its activations in E4M3 with a scale per row, and torch's eager version
(abs, amax, divide, clamp, divide, clamp, cast) is seven kernels before each of a layer's four
linears: in a CUDA-graph decode step that is more time than the quantization saves. One program
per row: the row read once into registers (up to ONE_PASS_MAX wide; else a pass for the amax and a
pass that scales), its amax, then scale, clamp and cast.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@triton.jit
def store_row_fp8(x, offs, mask, q_row_ptr, s_ptr, fp8_max, min_scale):
    """Store one row held in registers (float32, masked lanes 0) as E4M3 at `q_row_ptr + offs` with
    its scale amax / fp8_max at `s_ptr`: what the kernels that make an FP8 GEMM's input call last
    (this file's, and kernels/fused_ops.py's norms and SiLU-and-mul)."""
    scale = tl.maximum(tl.max(tl.abs(x), 0) / fp8_max, min_scale)
    tl.store(s_ptr, scale)
    q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_q,
    K,
    fp8_max,
    min_scale,
    ONE_PASS: tl.constexpr,  # BLOCK covers the row: one read, kept in registers
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        store_row_fp8(x, offs, offs < K, q_ptr + row * stride_q, s_ptr + row, fp8_max, min_scale)
        return
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / fp8_max, min_scale)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


# Rows up to this wide are read once and held in registers (the Llama-3.1-8B down projection's 14,336
# included); wider ones take two passes of 1,024.
ONE_PASS_MAX = 16384
MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


class QuantizedRows(NamedTuple):
    """Rows quantized to E4M3 with one float32 scale each: a row's real values are `q * scale`."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] float32


def empty_quantized(rows: int, cols: int, device: torch.device) -> QuantizedRows:
    """Buffers for `rows` quantized rows of `cols`."""
    return QuantizedRows(
        torch.empty((rows, cols), dtype=FP8_DTYPE, device=device),
        torch.empty((rows, 1), dtype=torch.float32, device=device),
    )


def quantize_rows_fused(x: torch.Tensor) -> QuantizedRows:
    """`quantize_rows` of a 2-D `x` (unit stride on the last dim): (E4M3 `[M, K]`, float32 `[M, 1]`)."""
    m, k = x.shape
    q, s = empty_quantized(m, k, x.device)
    if m:
        one_pass = k <= ONE_PASS_MAX
        block = triton.next_power_of_2(k) if one_pass else 1024
        _quantize_rows_kernel[(m,)](
            x,
            q,
            s,
            x.stride(0),
            q.stride(0),
            k,
            FP8_MAX,
            MIN_SCALE,
            ONE_PASS=one_pass,
            BLOCK=block,
            num_warps=8 if block > 4096 else 4,
        )
    return QuantizedRows(q, s)
