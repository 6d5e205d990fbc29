"""The decoder's building blocks shared by every family: `FusedLinear` (one matmul for a LoRA group's
stacked outputs; the FP8 base subclasses it in models/quantization/fp8_linear.py), `RMSNorm` (fused
with the residual add and, for an FP8 base, the next GEMM's input quantization on CUDA) and `Addend`
(a linear's output with the LoRA delta still to add, which the next fused kernel adds)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.fp8_quant import QuantizedRows
from loraplex.kernels.fused_ops import add_rms_norm, rms_norm
from loraplex.kernels.placement import triton_runs_on


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class FusedLinear(nn.Module):
    """One matmul for several stacked output blocks (e.g. q, k, v) that share an input."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...], bias: bool):
        super().__init__()
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight = empty_param(sum(out_sizes), in_features)
        self.bias = empty_param(sum(out_sizes)) if bias else None

    def input_quant(self, x_like: torch.Tensor) -> QuantizedRows | None:
        """Buffers for the op that makes this linear's input to write it into quantized as well (an
        FP8 base's W8A8 GEMM: models/quantization/fp8_linear.py); None: the input as it is."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {kind} this layer was not built with")
        start, size = self.offsets[index], self.out_sizes[index]
        dest = target.data[start : start + size]
        if dest.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(tensor)


class Addend(NamedTuple):
    """A linear's output and the float32 LoRA delta still to be added to it (None: nothing pending)."""

    out: torch.Tensor
    delta: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor:
        if self.delta is not None:
            self.out.add_(self.delta)  # dtype(float(out) + delta), as the in-place expand rounds
        return self.out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma: scale by (1 + weight) in float32, then cast
        self.weight = empty_param(size)

    def forward(self, x: torch.Tensor, quant: QuantizedRows | None = None) -> torch.Tensor:
        """`quant`: buffers the fused launch also writes the result into, quantized per token
        (`Fp8Linear.input_quant`, which offers them only where that launch runs)."""
        if triton_runs_on(x) and x.dim() == 2:  # one fused launch instead of seven (kernels/fused_ops.py)
            return rms_norm(x, self.weight, self.eps, self.unit_offset, quant)
        no_quant_here(quant)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        # Llama: cast back before the weight, as transformers does.
        return self.weight * h.to(x.dtype)

    def add_forward(
        self,
        h: torch.Tensor,
        addend: Addend | None,
        h_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        quant: QuantizedRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + addend, norm of it); one launch on CUDA (kernels/fused_ops.py `add_rms_norm`).
        `h_out` / `out`: static buffers to write the two results into (`h_out` may be `h`).
        `quant`: as `forward`'s."""
        if addend is None:
            if h_out is not None and h_out is not h:
                h = h_out.copy_(h)
            normed = self(h, quant)
            return h, normed if out is None else out.copy_(normed)
        if triton_runs_on(h) and h.dim() == 2:
            return add_rms_norm(
                h,
                addend.out,
                self.weight,
                self.eps,
                addend.delta,
                h_out=h_out,
                out=out,
                unit_offset=self.unit_offset,
                quant=quant,
            )
        no_quant_here(quant)
        h = h + addend.materialize()
        if h_out is not None:
            h = h_out.copy_(h)
        normed = self(h)
        return h, normed if out is None else out.copy_(normed)


def no_quant_here(quant: QuantizedRows | None) -> None:
    if quant is not None:
        raise ValueError("quantized outputs come only from the fused Triton launch (2-D rows)")
