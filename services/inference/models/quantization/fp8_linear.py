"""FP8 base linears for the Llama-family model: built in place of the fused float linears, filled
from the checkpoint (quantizing float weights at load, or copying E4M3 weights and their scales).

The LoRA delta is untouched: the model's `_linear` calls the module for the base output and the
LoRA backend adds its delta in the activation dtype beside it, as over a float base.

Scales are float32 buffers (not parameters), so `load_weights`' completeness check still counts
only the checkpoint's weights; `finish_loading` checks every scale arrived.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from loraplex.kernels.fp8_gemm_choice import fp8_gemm_kernel, keeps_block_scales
from loraplex.kernels.fp8_matmul import (
    FP8_DTYPE,
    dequantize,
    fp8_linear_mm,
    fp8_linear_ref,
    quantize_rows,
    scaled_mm_fits,
)
from loraplex.kernels.fp8_quant import QuantizedRows, empty_quantized
from loraplex.kernels.fp8_weight_gemm import fp8_w8a8_gemm, fp8_weight_gemm
from loraplex.kernels.fused_ops import fuses_quant
from loraplex.kernels.settings import kernel_settings
from loraplex.services.inference.models.checkpoint_load import LAYER_WEIGHTS
from loraplex.services.inference.models.layers import FusedLinear
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.quantization.scheme import Fp8Scheme
from loraplex.services.inference.models.value_checks import check_scale

log = logging.getLogger(__name__)

SCALE_KINDS = ("weight_scale", "weight_scale_inv", "input_scale")
_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight_scale|weight_scale_inv|input_scale)$")


class Fp8Linear(FusedLinear):
    """A `FusedLinear` whose weight is E4M3 `[N, K]` with float32 scales (see kernels/fp8_matmul.py)."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...], bias: bool, scheme: Fp8Scheme):
        nn.Module.__init__(self)  # not FusedLinear's: it would allocate a float weight first
        self.out_sizes = out_sizes
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.scheme = scheme
        self.block = scheme.block
        n = sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n), requires_grad=False) if bias else None
        # The checkpoint's own block, whose grid each projection's weight_scale_inv has.
        self.checkpoint_block = self.block
        if self.block is None:
            scale_shape = (n, 1)
        else:
            bn, bk = self.block
            if any(size % bn for size in out_sizes):
                # A projection ends inside a row block (ceil(rows / bn) blocks, the last one partial,
                # e.g. 576 rows of 128-row blocks): the stacked projections' grids do not line up as
                # one grid, so each row keeps its block's scales (a (1, bk) grid, expanded at load).
                self.block = (1, bk)
                scale_shape = (n, math.ceil(in_features / bk))
            else:
                scale_shape = (n // bn, math.ceil(in_features / bk))
        # NaN until loaded: finish_loading refuses a checkpoint that left any scale out.
        self.register_buffer("weight_scale", torch.full(scale_shape, math.nan, dtype=torch.float32))
        self.register_buffer("input_scale", torch.full((len(out_sizes),), math.nan, dtype=torch.float32))
        self.register_buffer("scale_row", None)  # [1, N] per-channel scale for the GPU GEMM
        self.register_buffer("static_input_scale", None)  # one per-tensor scale for the GPU GEMM

    @classmethod
    def replacing(cls, module: FusedLinear, scheme: Fp8Scheme) -> Fp8Linear:
        return cls(module.weight.shape[1], module.out_sizes, module.bias is not None, scheme)

    def forward(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        return self.base_matmul(x, self.bias, xq)

    def _kernel(self, x: torch.Tensor) -> str:
        scaled_mm_ready = self.scale_row is not None and scaled_mm_fits(x, self.weight)
        return fp8_gemm_kernel(x, self.block, scaled_mm_ready, tuple(self.weight.shape))

    def input_quant(self, x_like: torch.Tensor) -> QuantizedRows | None:
        """Empty buffers for this linear's input quantized per token, for the op that makes the input
        (a norm, SiLU-and-mul: kernels/fused_ops.py) to fill in the same launch; None where the GEMM
        for an input of `x_like`'s rows, dtype and device does not take per-token E4M3 activations
        (only the W8A8 GEMM does). Saves a launch per linear: a Llama-3.1-8B step's batch-64 FP8 step
        1.015-1.025x slower with a quantization launch before each GEMM (H100, 2026-12-06)."""
        width = self.weight.shape[1]
        if not fuses_quant(width):
            return None
        if self.static_input_scale is not None or self._kernel(x_like) != "w8a8":
            return None
        return empty_quantized(x_like.numel() // x_like.shape[-1], width, x_like.device)

    def base_matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, xq: QuantizedRows | None = None
    ) -> torch.Tensor:
        """`xq`: x already quantized per token (`input_quant`'s buffers, filled: offered only where
        the W8A8 GEMM serves x, so the choice is not made again)."""
        kernel = "w8a8" if xq is not None else self._kernel(x)
        if kernel == "weight_only":
            return fp8_weight_gemm(x, self.weight, self.weight_scale, self.block, bias)
        if kernel == "w8a8":
            return fp8_w8a8_gemm(
                x, self.weight, self.weight_scale, self.block, bias, None, self.static_input_scale, xq
            )
        if kernel == "scaled_mm":
            return fp8_linear_mm(x, self.weight, self.scale_row, self.static_input_scale, bias)
        return fp8_linear_ref(x, self.weight, self.weight_scale, self.block, bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block, dtype)

    def _rows(self, index: int) -> slice:
        start = self.offsets[index]
        return slice(start, start + self.out_sizes[index])

    def load_shard(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        if kind == "bias":
            return super().load_shard(index, kind, tensor)
        rows = self._rows(index)
        dest = self.weight.data[rows]
        if dest.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
        if tensor.dtype == FP8_DTYPE:
            if not self.scheme.prequantized:
                raise ValueError("an FP8 weight in a checkpoint whose config.json declares no quantization")
            dest.copy_(tensor)
            return None
        if self.scheme.prequantized:
            raise ValueError(f"a {tensor.dtype} weight where the checkpoint's {self.scheme.name} needs FP8")
        q, scale = quantize_rows(tensor.to(dest.device))
        dest.copy_(q)
        self.weight_scale[rows] = scale
        return None

    def load_scale(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(device=self.weight_scale.device, dtype=torch.float32)
        if kind == "input_scale":
            self.input_scale[index] = tensor.reshape(())
            return
        if (kind == "weight_scale_inv") != (self.block is not None):
            raise ValueError(f"{kind} does not belong to a {self.scheme.name} checkpoint")
        if self.block is None:
            rows, size = self._rows(index), self.out_sizes[index]
            if tensor.numel() not in (1, size):
                raise ValueError(f"weight_scale of {tensor.numel()} values for {size} rows")
            self.weight_scale[rows] = tensor.reshape(-1, 1).expand(size, 1)
            return
        if self.block[0] == 1 and self.checkpoint_block[0] != 1:
            return self._load_block_rows(index, tensor)
        bn = self.block[0]
        start, size = self.offsets[index] // bn, self.out_sizes[index] // bn
        dest = self.weight_scale[start : start + size]
        if dest.shape != tensor.shape:
            raise ValueError(f"weight_scale_inv shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(tensor)

    def _load_block_rows(self, index: int, tensor: torch.Tensor) -> None:
        """A projection's `[ceil(rows / bn), ceil(in / bk)]` block scales, one row of them per weight
        row (`index` -1: a fused checkpoint tensor covering every stacked projection)."""
        bn = self.checkpoint_block[0]
        start, size = (0, sum(self.out_sizes)) if index < 0 else (self.offsets[index], self.out_sizes[index])
        expected = (math.ceil(size / bn), self.weight_scale.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight_scale_inv shape {tuple(tensor.shape)} does not fit {expected}")
        self.weight_scale[start : start + size] = tensor.repeat_interleave(bn, dim=0)[:size]

    def finish(self, fast: bool) -> None:
        """Check every scale arrived; with `fast` (CUDA), ready the hardware GEMM's operands: a
        block-scaled weight is re-quantized per output channel once (cuBLASLt's row-wise FP8 GEMM, the
        W8A8 GEMM), unless the weight-only GEMM serves it with its own block scales (`LORAPLEX_FP8_GEMM`)."""
        if torch.isnan(self.weight_scale).any():
            raise ValueError("the checkpoint has an FP8 weight without its weight_scale")
        if self.scheme.static_activations and torch.isnan(self.input_scale).any():
            raise ValueError("the checkpoint declares static activations but has no input_scale")
        if not fast or keeps_block_scales(self.block):
            return
        if self.block is not None:
            q, scale = quantize_rows(self.dequantized(torch.float32))
            self.weight.data.copy_(q)
            self.weight_scale = scale
            self.block = None
        self.scale_row = self.weight_scale.reshape(1, -1).contiguous()
        if self.scheme.static_activations:
            # One scale for the fused GEMM: the largest of its parts' never clips any of them.
            self.static_input_scale = self.input_scale.max().reshape(1, 1)


LINEAR_ATTRS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_linears(
    model: LlamaForCausalLM, scheme: Fp8Scheme, replacements: dict[type, type[Fp8Linear]] | None = None
) -> None:
    """Swap every layer's fused linears for FP8 ones (before weights are loaded). `replacements`:
    the FP8 class for a subclass of FusedLinear (tensor parallelism's row-parallel linear)."""
    replacements = replacements or {}
    for layer in model.layers:
        for attr in LINEAR_ATTRS:
            module = getattr(layer, attr)
            cls = replacements.get(type(module), Fp8Linear)
            setattr(layer, attr, cls.replacing(module, scheme))
    model.fp8_scheme = scheme


def route_scales(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
    """Feed scale tensors to their FP8 linears; pass every other tensor on to `load_weights`.
    Refuses an FP8 tensor outside the quantized linears (lm_head, embedding, norms)."""
    for name, tensor in weights:
        match = _SCALE_RE.match(name)
        if match and match[2] in LAYER_WEIGHTS:
            attr, index = LAYER_WEIGHTS[match[2]]
            check_scale(name, tensor)  # finite and positive (models/value_checks.py)
            getattr(model.layers[int(match[1])], attr).load_scale(index, match[3], tensor)
            continue
        if name.endswith(SCALE_KINDS) or name.endswith((".k_scale", ".v_scale", ".output_scale")):
            raise ValueError(f"{name!r}: loraplex quantizes only the decoder layers' linears")
        if tensor.dtype == FP8_DTYPE and not name.endswith(".weight"):
            raise ValueError(f"{name!r} is FP8 but is not a linear's weight")
        if tensor.dtype == FP8_DTYPE and ".layers." not in name:
            raise ValueError(f"{name!r} is FP8: only the decoder layers' linears may be")
        yield name, tensor


def finish_loading(model: LlamaForCausalLM) -> None:
    fast = False
    for layer in model.layers:
        for attr in LINEAR_ATTRS:
            module: Fp8Linear = getattr(layer, attr)
            fast = module.weight.is_cuda and scaled_mm_fits(module.weight, module.weight)
            module.finish(fast)
    if model.layers[0].qkv_proj.weight.is_cuda:
        # The float linears the FP8 ones replaced sit in torch's cache, which the KV-cache sizing
        # (engine/kv_cache.py, from free device memory) would count as used.
        torch.cuda.empty_cache()
    scheme: Fp8Scheme = model.fp8_scheme
    gemm = kernel_settings().fp8_gemm
    if not fast:
        how = "dequantizing reference path (activations not quantized)"
    elif keeps_block_scales(scheme.block):
        how = f"weight-only FP8 GEMM with the checkpoint's block scales (LORAPLEX_FP8_GEMM={gemm})"
    else:
        how = "torch._scaled_mm, per-token activation scales" + (
            ", block scales re-quantized per output channel" if scheme.block else ""
        )
        if gemm in ("weight_only", "w8a8"):
            how += f"; Triton {gemm} FP8 GEMM for every batch (LORAPLEX_FP8_GEMM={gemm})"
        elif gemm == "auto":
            how += "; per shape the faster of it and the Triton FP8 GEMMs (LORAPLEX_FP8_GEMM=auto)"
    log.info("FP8 base linears (%s): %s", scheme.name, how)


def quantize_loaded(model: LlamaForCausalLM, scheme: Fp8Scheme | None = None) -> LlamaForCausalLM:
    """Quantize an already loaded float model's linears per output channel, in place, one linear
    at a time (each float weight is freed as its FP8 copy is made): what benchmarks compare."""
    scheme = scheme or Fp8Scheme("fp8 (quantized at load)", prequantized=False)
    for layer in model.layers:
        for attr in LINEAR_ATTRS:
            old: FusedLinear = getattr(layer, attr)
            with torch.device(old.weight.device):
                new = Fp8Linear.replacing(old, scheme)
            for index, size in enumerate(old.out_sizes):
                start = old.offsets[index]
                new.load_shard(index, "weight", old.weight.data[start : start + size])
            if old.bias is not None:
                new.bias = old.bias
            setattr(layer, attr, new)
    model.fp8_scheme = scheme
    finish_loading(model)
    return model


def load_fp8(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`model.load_weights` over an FP8 model (after `quantize_linears`), then the scale checks."""
    model.load_weights(route_scales(model, weights))
    finish_loading(model)
