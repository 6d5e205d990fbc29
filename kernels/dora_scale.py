"""DoRA's per-row scale of a module group's output, one launch (lora/dora.py, `LoRABackend.dora`).

For each token row `t` of `out` `[T, N]` (the base output `W x + b`, the LoRA delta added in place
or handed over as float32 `delta`), with `f = table[index[t]]` (its slot's factor row, or the row
of ones for tokens of other adapters or none):

    out[t] = f * (out[t] - b + delta[t]) + b        (float32, rounded once to out's dtype)

Why a kernel: in a decode graph's kinds variant this runs once per group and layer (128 times a
step at 32 layers), and torch's version materialises each token's factor row (`index_select`)
and makes two or three more passes over `[T, N]` float32; here the factor rows, a few per layer,
stay in L2 and `out` is read and written once. `dora_scale_ref` is the torch reference, what the
CPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _dora_scale_kernel(
    out_ptr,
    d_ptr,  # the handed-over delta (float32)
    bias_ptr,
    factor_ptr,  # the factor table (float32)
    slots_ptr,  # each token's row of it (int64)
    stride_o,
    stride_d,
    stride_t,
    N,
    HAS_DELTA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    slot = tl.load(slots_ptr + row).to(tl.int64)
    f = tl.load(factor_ptr + slot * stride_t + offs, mask=mask, other=1.0)
    o_ptrs = out_ptr + row.to(tl.int64) * stride_o + offs
    y = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y - b
    if HAS_DELTA:
        y = y + tl.load(d_ptr + row.to(tl.int64) * stride_d + offs, mask=mask, other=0.0)
    y = y * f
    if HAS_BIAS:
        y = y + b
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def dora_scale(
    out: torch.Tensor,
    delta: torch.Tensor | None,
    bias: torch.Tensor | None,
    table: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """`out` scaled in place (see the module docstring); `table` float32 `[rows, N]`, `index` int64
    `[T]`, `delta` float32 `[T, N]` or None, `bias` `[N]` or None. Returns `out`."""
    T, N = out.shape
    assert out.stride(1) == 1 and table.stride(1) == 1 and index.shape[0] >= T
    if delta is not None:
        assert delta.stride(1) == 1 and delta.dtype == torch.float32
    if T == 0:
        return out
    _dora_scale_kernel[(T, triton.cdiv(N, BLOCK))](
        out,
        out if delta is None else delta,
        out if bias is None else bias,
        table,
        index,
        out.stride(0),
        0 if delta is None else delta.stride(0),
        table.stride(0),
        N,
        HAS_DELTA=delta is not None,
        HAS_BIAS=bias is not None,
        BLOCK=BLOCK,
    )
    return out


def dora_scale_ref(
    out: torch.Tensor,
    delta: torch.Tensor | None,
    bias: torch.Tensor | None,
    table: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """The torch reference of `dora_scale` (in place, same rounding: float32, then once to out's dtype)."""
    factor = table.index_select(0, index[: out.shape[0]])
    if bias is None and delta is None:
        return out.mul_(factor)
    y = out.to(torch.float32)
    if bias is not None:
        y = y - bias.to(torch.float32)
    if delta is not None:
        y = y + delta
    y = y * factor
    if bias is not None:
        y = y + bias.to(torch.float32)
    return out.copy_(y)


def warm_up(widths: list[int], dtype: torch.dtype, device: torch.device) -> None:
    """Compile the kernel's variants (with and without a delta and a bias) at these group widths at
    start-up, so the first step holding a DoRA adapter (its graph captured lazily) compiles nothing."""
    for n in sorted(set(widths)):
        out = torch.zeros(1, n, dtype=dtype, device=device)
        table = torch.ones(2, n, dtype=torch.float32, device=device)
        index = torch.zeros(1, dtype=torch.int64, device=device)
        delta = torch.zeros(1, n, dtype=torch.float32, device=device)
        bias = torch.zeros(n, dtype=dtype, device=device)
        for d in (None, delta):
            for b in (None, bias):
                dora_scale(out, d, b, table, index)
