"""Skinny gated GEMM for decode-sized batches: `act(x @ gate.T) * (x @ up.T)` (SwiGLU or GeGLU) for
`x [M, K]` with M <= 64 rows, the stacked gate_up weight streamed once from memory in bf16 and the
activation in the epilogue, so the MLP's gate_up projection and its SiLU-and-mul are one launch.

Why: at batch 64 a decode step's matmuls are pure weight streaming (64 rows against 4096-14336
columns), and cuBLAS reaches ~3.6 of the H200's 4.25 TB/s on them (docs/benchmarks.md, "Where the
base decode step goes"). Here each program owns BLOCK_N output columns and one of SPLIT_K slices of K;
the dot is computed swapped (`weight_tile @ x_tile.T`, BLOCK_N x BLOCK_M), so the weight rows fill the
tensor core's wide side and a batch of 16 pads to 16, not 64.

Split-K in one launch: each slice writes its float32 partial tile to a workspace, then bumps a
per-column-tile counter; the program that arrives last sums the partials in slice order (so the
result does not depend on who came last), applies the epilogue and resets the counter to 0 for the
next launch. The counters live as long as the process (one buffer per device, never reallocated: a
captured CUDA graph keeps its address), the workspace is allocated per call, as the decode
attention's partials are.

It serves gate_up wherever Triton runs and no LoRA delta is pending (`skinny_serves`): with the fused
KV store, the direct single-split decode and cuBLASLt it made the batch-64 step 8.90 against 9.10 ms (H100,
2026-12-05). The same kernel as a plain linear (no activation) was slower than cuBLAS on every
projection but the LM head and made the step 0.89-0.95x as fast, so it was removed (docs/benchmarks.md,
"Facts behind defaults"). Block sizes and K splits come from `default_config`'s rule (the per-shape
table it once had was never filled in, and went with the sweep that would have filled it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loraplex.kernels.fused_ops import silu_and_mul_ref, tanh
from loraplex.kernels.placement import triton_runs_on
from loraplex.kernels.settings import kernel_settings

SKINNY_MAX_ROWS = 64
MAX_SPLIT_K = 16
COUNTER_SLOTS = 1 << 16  # column tiles a split-K launch may have
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def rows_block(rows: int) -> int:
    """The compiled row tile: two variants (<= 16 rows, <= 64) so a ladder of batch sizes compiles twice."""
    return 16 if rows <= 16 else 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def default_config(rows: int, n: int, k: int, device: torch.device) -> SkinnyConfig:
    """32 columns per tile (two accumulators: gate and up), 128-wide K steps, and as many K slices as
    bring the grid to about two programs per SM (each slice at least four K steps)."""
    block_n, block_k = 32, 128
    tiles = triton.cdiv(n, block_n)
    target = 2 * _num_sms(device)
    split = 1
    if tiles < target:
        split = max(1, min(triton.cdiv(target, tiles), k // (4 * block_k), MAX_SPLIT_K))
    return SkinnyConfig(block_n, block_k, split)


_counters: dict[str, torch.Tensor] = {}


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters, zero between launches (each launch leaves them zero).
    Shared by every launch on the device: skinny GEMMs must not run on two streams at once (the LoRA
    side stream runs only LoRA kernels). Made inside a CUDA-graph capture, the graph also zeroes it
    at each replay's start, which is harmless."""
    key = str(device)
    if key not in _counters:
        _counters[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _counters[key]


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    stride_xm,
    stride_wn,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    K_PER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,  # 1: SiLU, 2: tanh-GELU (GeGLU)
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k0 = pid_k * K_PER
    for kk in range(0, K_PER, BLOCK_K):
        ks = k0 + kk + offs_k
        if EVEN_K:
            k_mask = offs_k < BLOCK_K
        else:
            k_mask = ks < K
        # x tile transposed [BLOCK_K, BLOCK_M]; rows past M read as zeros
        x = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + ks[:, None],
            mask=m_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
        # the up half: rows N.. of the stacked gate_up weight
        wu = tl.load(w_ptr + (N + offs_n)[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        acc_up = tl.dot(wu, x, acc_up, input_precision=PRECISION)
    if SPLIT_K > 1:
        # partials [SPLIT_K, 2, BLOCK_M, N] float32: slice pid_k's tile, then the arrival count
        tile = offs_m[None, :] * N + offs_n[:, None]
        base = part_ptr + pid_k * (2 * BLOCK_M * N)
        tl.store(base + tile, acc, mask=n_mask[:, None])
        tl.store(base + BLOCK_M * N + tile, acc_up, mask=n_mask[:, None])
        tl.debug_barrier()  # every thread's partial written before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived < SPLIT_K - 1:
            return
        tl.atomic_xchg(count_ptr + pid_n, 0)  # zero again for the next launch
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # in slice order: the sum is the same whoever came last
            src = part_ptr + s * (2 * BLOCK_M * N)
            acc += tl.load(src + tile, mask=n_mask[:, None], other=0.0, cache_modifier=".cg")
            acc_up += tl.load(src + BLOCK_M * N + tile, mask=n_mask[:, None], other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dt = out_ptr.dtype.element_ty
    # Round where the unfused path rounds: the matmul's output, the activation, the product.
    g = acc.to(dt).to(tl.float32)
    u = acc_up.to(dt).to(tl.float32)
    if ACT == 2:
        act = (0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))).to(dt).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    y = (act * u).to(dt)
    tl.store(
        out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=m_mask[None, :] & n_mask[:, None]
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    activation: str,
    config: SkinnyConfig | None,
) -> torch.Tensor:
    rows, k = x.shape
    if not 0 < rows <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny GEMM takes 1..{SKINNY_MAX_ROWS} rows, got {rows}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError("x and weight need a contiguous last dimension of the same width")
    cfg = config or default_config(rows, n, k, x.device)
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    k_per = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)  # no empty slices
    tiles = triton.cdiv(n, cfg.block_n)
    block_m = rows_block(rows)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if split > 1:
        if tiles > COUNTER_SLOTS:
            raise ValueError(f"{tiles} column tiles exceed the {COUNTER_SLOTS} split-K counters")
        part = torch.empty((split, 2, block_m, n), dtype=torch.float32, device=x.device)
        count = _counter_buffer(x.device)
    else:
        part, count = out, out  # never read
    _skinny_kernel[(tiles, split)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        count,
        rows,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        N=n,
        K=k,
        K_PER=k_per,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        EVEN_K=split * k_per == k,
        HAS_BIAS=bias is not None,
        ACT=ACTIVATIONS[activation],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def skinny_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "silu",
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """`act(gate) * up` of `F.linear(x, weight, bias)` with `weight` = `[2 * inter, K]` (gate rows
    first, as the fused gate_up linear stacks them): `[M, inter]`, one launch. `activation`:
    "silu" or "gelu_tanh" (GeGLU)."""
    return _launch(x, weight, bias, weight.shape[0] // 2, activation, config)


def skinny_gated_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    return silu_and_mul_ref(F.linear(x, weight, bias), activation=activation)


def skinny_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the gated matmul of `x` by the stacked gate_up `weight` runs as one skinny launch: a
    Triton device, 1..64 rows, weight in the activations' 16-bit dtype (float32 only where the
    interpreter runs, for tests; an FP8 linear has its own forward)."""
    s = kernel_settings()
    if x.dim() != 2 or not 0 < x.shape[0] <= SKINNY_MAX_ROWS or not triton_runs_on(x):
        return False
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if s.triton_interpret else ())
    return x.dtype == weight.dtype and x.dtype in dtypes and x.stride(-1) == 1 and weight.stride(-1) == 1
