"""Fused element-wise kernels for the decoder layer on CUDA: RMSNorm (alone, or after the residual
add) and SiLU-and-mul (the q/k/v split with rotary is in kernels/qkv_rotary.py).

Why: in a CUDA-graph decode step every kernel costs a few microseconds however little it does,
and torch's eager RMSNorm (7 kernels), rotary (6 per tensor) and `silu(gate) * up` (3) would
make about 30 of a layer's ~40 kernels. Each function here is one launch and rounds exactly where
the torch code it replaces rounds (services/inference/models/llama.py, rope.py), so results
agree with the torch path to about one unit in the last place of the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fp8_quant import FP8_MAX, MIN_SCALE, ONE_PASS_MAX, QuantizedRows, store_row_fp8


@triton.jit
def tanh(x):
    """tanh from exp(-2|x|), which never overflows (Triton has no portable tanh)."""
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


@triton.jit
def _scale_normed(x, rstd, w, dt, UNIT_OFFSET: tl.constexpr):
    """The normalised row times its weight, rounded where transformers rounds: Llama casts `x / rms`
    to the dtype before `weight *`; Gemma multiplies by `1 + weight` in float32, then casts."""
    if UNIT_OFFSET:
        return (x * rstd * (1.0 + w)).to(dt)
    return (w * (x * rstd).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    xq_ptr,
    xs_ptr,
    stride_x,
    stride_o,
    stride_xq,
    eps,
    fp8_max,
    min_scale,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    QUANT: tl.constexpr,  # also store the output as E4M3 with its row scale (an FP8 GEMM's input)
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _scale_normed(x, rstd, w, out_ptr.dtype.element_ty, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if QUANT:
        q_row = xq_ptr + row * stride_xq
        store_row_fp8(out.to(tl.float32), offs, mask, q_row, xs_ptr + row, fp8_max, min_scale)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    quant: QuantizedRows | None = None,
) -> torch.Tensor:
    """`weight * (x / rms(x)).to(x.dtype)` over the last dim of a 2-D `x`, as transformers computes it
    (`unit_offset`: Gemma's `((x / rms(x)) * (1 + weight)).to(x.dtype)`). `quant`: buffers that also
    receive the result quantized per row (`quantize_rows_fused` of it, bit for bit)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x,
            weight,
            out,
            *_quant_pointers(quant, out),
            x.stride(0),
            out.stride(0),
            _quant_stride(quant),
            eps,
            FP8_MAX,
            MIN_SCALE,
            N=n,
            BLOCK=block,
            UNIT_OFFSET=unit_offset,
            QUANT=quant is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out


def _quant_pointers(quant: QuantizedRows | None, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (dummy, dummy) if quant is None else (quant.q, quant.scale)


def _quant_stride(quant: QuantizedRows | None) -> int:
    return 0 if quant is None else quant.q.stride(0)


def fuses_quant(width: int) -> bool:
    """Whether this file's kernels can quantize a `width`-wide output row (held whole in registers)."""
    return width <= ONE_PASS_MAX


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,
    y_ptr,
    d_ptr,
    w_ptr,
    h_out_ptr,
    out_ptr,
    xq_ptr,
    xs_ptr,
    stride_h,
    stride_y,
    stride_d,
    stride_ho,
    stride_o,
    stride_xq,
    eps,
    fp8_max,
    min_scale,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    QUANT: tl.constexpr,  # also store the normed row as E4M3 with its row scale (an FP8 GEMM's input)
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = h_out_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the linear's LoRA delta, rounded into its output as the in-place add does
        y = (y + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    s = (h + y).to(dt)  # the residual add rounds to the dtype
    tl.store(h_out_ptr + row * stride_ho + offs, s, mask=mask)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _scale_normed(x, rstd, w, dt, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_o + offs, normed, mask=mask)
    if QUANT:
        store_row_fp8(
            normed.to(tl.float32), offs, mask, xq_ptr + row * stride_xq, xs_ptr + row, fp8_max, min_scale
        )


def add_rms_norm(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    unit_offset: bool = False,
    quant: QuantizedRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h + y` (y plus its float32 LoRA `delta` first, when given) and `rms_norm` of that, in one
    launch: the residual add before each RMSNorm of a decoder layer. Returns (new h, normed).
    `h_out` / `out`: write them there (`h_out` may be `h`: each row is read before it is written).
    `quant`: buffers that also receive `normed` quantized per row, as `rms_norm`'s."""
    rows, n = h.shape
    h_out = torch.empty_like(h) if h_out is None else h_out
    out = torch.empty_like(h) if out is None else out
    if rows:
        block = triton.next_power_of_2(n)
        d = delta if delta is not None else y
        _add_rms_norm_kernel[(rows,)](
            h,
            y,
            d,
            weight,
            h_out,
            out,
            *_quant_pointers(quant, out),
            h.stride(0),
            y.stride(0),
            d.stride(0),
            h_out.stride(0),
            out.stride(0),
            _quant_stride(quant),
            eps,
            FP8_MAX,
            MIN_SCALE,
            N=n,
            BLOCK=block,
            HAS_DELTA=delta is not None,
            UNIT_OFFSET=unit_offset,
            QUANT=quant is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return h_out, out


def add_rms_norm_ref(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        y = (y.float() + delta).to(y.dtype)
    h = h + y
    return h, rms_norm_ref(h, weight, eps, unit_offset)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    d_ptr,
    out_ptr,
    xq_ptr,
    xs_ptr,
    stride_x,
    stride_d,
    stride_o,
    stride_xq,
    fp8_max,
    min_scale,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    GELU_TANH: tl.constexpr,
    QUANT: tl.constexpr,  # BLOCK covers the row: also store it as E4M3 with its row scale
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if HAS_DELTA:  # gate_up's LoRA delta, rounded in as the in-place add does
        g = (g + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
        u = (u + tl.load(d_ptr + row * stride_d + N + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
    if GELU_TANH:  # Gemma's gelu_pytorch_tanh
        act = (0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))).to(dt).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch's silu rounds before the mul
    out = (act * u).to(dt)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if QUANT:
        q_row = xq_ptr + row * stride_xq
        store_row_fp8(out.to(tl.float32), offs, mask, q_row, xs_ptr + row, fp8_max, min_scale)


def silu_and_mul(
    gate_up: torch.Tensor,
    delta: torch.Tensor | None = None,
    activation: str = "silu",
    quant: QuantizedRows | None = None,
) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` = `[T, 2 * inter]` (gate first, as the fused linear stacks them),
    plus its float32 LoRA `delta` (same shape) first, when given. `activation` "gelu_tanh": GeGLU,
    `gelu(gate, approximate="tanh") * up` (Gemma). `quant`: buffers that also receive the result
    quantized per row, as `rms_norm`'s (rows up to `ONE_PASS_MAX` wide: one program per row)."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if quant is not None and not fuses_quant(n):
        raise ValueError(f"silu_and_mul quantizes rows up to {ONE_PASS_MAX} wide (got {n})")
    if rows:
        # A row's amax needs the whole row in one program; otherwise 1,024 columns per program.
        block = 1024 if quant is None else triton.next_power_of_2(n)
        d = delta if delta is not None else gate_up
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up,
            d,
            out,
            *_quant_pointers(quant, out),
            gate_up.stride(0),
            d.stride(0),
            out.stride(0),
            _quant_stride(quant),
            FP8_MAX,
            MIN_SCALE,
            N=n,
            BLOCK=block,
            HAS_DELTA=delta is not None,
            GELU_TANH=activation == "gelu_tanh",
            QUANT=quant is not None,
            num_warps=4 if block <= 1024 else min(16, block // 512),
        )
    return out


def silu_and_mul_ref(
    gate_up: torch.Tensor, delta: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    if delta is not None:
        gate_up = (gate_up.float() + delta).to(gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up
