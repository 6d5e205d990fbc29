"""FP8 GEMMs for few rows (decode): `x @ (weight * scale).T (+ bias)` over an E4M3 weight `[N, K]` read
once, float32 accumulation, in two forms of one kernel:

- weight-only (`fp8_weight_gemm`): x in bf16/fp16, the weight widened to x's dtype in registers;
- W8A8 (`fp8_w8a8_gemm`): x quantized per token (kernels/fp8_matmul.py's `quantize_activations`, as
  `torch._scaled_mm` has it) and an FP8 x FP8 MMA, the token scales applied after the K loop (deep
  pipelined K steps; split-K where the sweep found it pays, the down projection's long K).

Why: at a batch of 64 the base matmuls are bound by the weight bytes, which FP8 halves; the
`torch._scaled_mm` path pays an activation-quantize launch per projection and cuBLASLt's FP8 kernels
do not reach copy bandwidth at 64 rows. The weight-only form does not quantize activations at all
(also the more accurate); the W8A8 form keeps the MMA in FP8 (no widening in registers).

Layout: each program computes a `[BLOCK_N, BLOCK_M]` tile of the output's transpose, so the
weight (the big, widened operand) is the MMA's left side and the batch its narrow right side
(a Hopper MMA is 64 rows of the left operand by 8..256 columns). Scales, as in
kernels/fp8_matmul.py: per output channel `[N, 1]` (applied once, after the K loop) or per
`(bn, bk)` block `[ceil(N/bn), ceil(K/bk)]` (the block-wise checkpoint format, applied per K step,
whose length therefore divides bk). Split-K: `split_k` programs per tile each cover a range of K
and write float32 partials `[split_k, M, N]`; the tile's last program to finish (a per-tile arrival
counter) adds them in split order, adds the bias and casts. One launch, and the sum's order does not
depend on which program came last: the result is deterministic, as the decode graphs' replays must be.
The counters live in one int32 buffer per device, zero between launches (the last program resets its
tile's), so launches that share it run one at a time (one stream), as a model's linears do.

No autotuning and no host syncs: configs come from kernels/fp8_gemm_configs.py, chosen from shapes
alone, so the launches are captured in CUDA graphs as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fp8_gemm_configs import Fp8GemmConfig, fp8_gemm_config
from loraplex.kernels.fp8_matmul import dequantize, quantize_activations, quantize_rows
from loraplex.kernels.fp8_quant import QuantizedRows


# The rows (and what scales with them) are runtime values: a new batch size compiles nothing.
@triton.jit(do_not_specialize=["M", "stride_osplit"])
def _fp8_weight_gemm_kernel(
    x_ptr,
    xs_ptr,  # X_FP8: float32 per-row scales of x
    w_ptr,
    s_ptr,
    out_ptr,
    bias_ptr,
    part_ptr,  # SPLIT: float32 partials [splits, M, N]
    count_ptr,  # SPLIT: int32 arrivals per output tile, zero at launch and again at exit
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_om,
    stride_osplit,
    SCALE_BN: tl.constexpr,  # 0: per-channel scales; else the scale block's rows
    SCALE_BK: tl.constexpr,  # the scale block's columns (block scales only)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one program over K per tile: partials, the last one adds them
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K: no K masks
    X_FP8: tl.constexpr,  # x is E4M3 (W8A8): an FP8 MMA, x's row scales applied at the end
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_start + offs_k)[:, None]  # x^T tile [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if not X_FP8:
            w = w.to(xt.dtype)
        if SCALE_BN == 0:
            acc = tl.dot(w, xt, acc)
        else:
            # One scale per weight row for this K step (BLOCK_K divides SCALE_BK).
            s = tl.load(s_ptr + (offs_n // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk, mask=n_mask)
            acc += tl.dot(w, xt) * s[:, None]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SCALE_BN == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0)[:, None]
    if X_FP8:
        acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    tile_mask = n_mask[:, None] & m_mask[None, :]
    tile_offs = offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:
        tl.store(part_ptr + pid_k * stride_osplit + tile_offs, acc, mask=tile_mask)
        # Every thread's partial is written before the arrival is counted (release), and the last
        # program reads the others' only after it (acquire), from L2.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(2) - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(0, tl.num_programs(2)):
                part = part_ptr + i * stride_osplit + tile_offs
                acc += tl.load(part, mask=tile_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + tile_offs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (a graph replays this one)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + tile_offs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed arrival counters, at least `tiles` of them. Grown outside CUDA-graph capture
    only (a model's eager warm-up runs every shape its graphs capture first)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"FP8 GEMM: {tiles} split-K tile counters first needed inside a CUDA-graph capture"
            )
        _COUNTERS[device] = have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return have


def block_k_for(config: Fp8GemmConfig, block: tuple[int, int] | None) -> int:
    """The config's K step, narrowed for block scales to a power of two dividing the scale block's
    columns (one scale per weight row per step); 0 where none of at least 16 does."""
    if block is None:
        return config.block_k
    bk = min(config.block_k, block[1] & -block[1])  # largest power of two dividing block[1]
    return bk if bk >= 16 else 0


def supports(block: tuple[int, int] | None) -> bool:
    """Whether this GEMM can serve a weight with these scales (block scales need a power-of-two
    factor >= 16 in their column count; the published 128x128 format has it)."""
    return block is None or (block[1] & -block[1]) >= 16


def fp8_weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """`x [..., K]` (bf16/fp16; float32 in the interpreter) times the E4M3 `weight [N, K]` with
    float32 `scale` (`[N, 1]`, or `[ceil(N/bn), ceil(K/bk)]` for `block = (bn, bk)`): `[..., N]` in
    x's dtype. `config`: the tile sizes (default: kernels/fp8_gemm_configs.py's for this shape)."""
    x2 = _rows(x)
    config = config or fp8_gemm_config(x2.shape[0], *weight.shape, x.device)
    return _gemm(x2, None, weight, scale, block, bias, config, x.dtype).reshape(
        *x.shape[:-1], weight.shape[0]
    )


def fp8_w8a8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
    input_scale: torch.Tensor | None = None,
    xq: QuantizedRows | None = None,
) -> torch.Tensor:
    """As `fp8_weight_gemm`, with x quantized to E4M3 first: per token, or by the checkpoint's
    static per-tensor `input_scale` (`quantize_activations`), the MMA in FP8. `xq`: x already
    quantized per token by the op that made it (kernels/fused_ops.py), so no quantization launch."""
    x2 = _rows(x)
    config = config or fp8_gemm_config(x2.shape[0], *weight.shape, x.device, kernel="w8a8")
    xq, xs = quantize_activations(x2, input_scale) if xq is None else xq
    out = _gemm(xq, xs, weight, scale, block, bias, config, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gemm(
    x2: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    config: Fp8GemmConfig,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One launch over `[M, K]` rows; `x_scale` (`[M, 1]` float32) for E4M3 x."""
    n, k = weight.shape
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    if m == 0:
        return out
    block_k = block_k_for(config, block)
    if not block_k or weight.stride(1) != 1:
        raise ValueError(f"fp8_weight_gemm: weight {tuple(weight.shape)} with block {block} is not supported")
    k_steps = -(-k // block_k)
    k_per_split = -(-k_steps // config.split_k) * block_k
    splits = -(-k // k_per_split)  # requested splits past K's end would have nothing to add
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    split = splits > 1
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device) if split else out
    counters = tile_counters(x2.device, grid[0] * grid[1]) if split else out
    has_bias = bias is not None
    _fp8_weight_gemm_kernel[grid](
        x2,
        scale if x_scale is None else x_scale,  # dummy pointers where unused
        weight,
        scale,
        out,
        bias if has_bias else out,
        parts,
        counters,
        m,
        n,
        k,
        k_per_split,
        x2.stride(0),
        weight.stride(0),
        scale.stride(0),
        scale.stride(1) if scale.dim() == 2 else 0,
        n,
        m * n,
        SCALE_BN=0 if block is None else block[0],
        SCALE_BK=1 if block is None else block[1],
        HAS_BIAS=has_bias,
        SPLIT=split,
        EVEN_K=k % block_k == 0,
        X_FP8=x_scale is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fp8_weight_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the weight's real values (fp8 * scale) in float32, a float32 matmul (and bias),
    one rounding to x's dtype at the end, as the kernel's float32 accumulator does."""
    out = x.float() @ dequantize(weight, scale, block, torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_w8a8_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of `fp8_w8a8_gemm`: x quantized in torch (`quantize_rows` per token, or the static
    scale), then `fp8_weight_gemm_ref` over x's real values (fp8 * its row scale)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    xq, xs = quantize_rows(x2) if input_scale is None else quantize_activations(x2, input_scale)
    out = fp8_weight_gemm_ref(xq.float() * xs, weight, scale, block, bias).to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
