"""FP8 activations quantized by the launch that makes them (kernels/fused_ops.py's RMSNorms and
SiLU-and-mul with `quant` buffers, `Fp8Linear.input_quant`), under the Triton interpreter.

Each op's quantized output must be, bit for bit, what the separate quantization launch
(`quantize_rows_fused`) makes of its unquantized output; a decoder over an FP8 base served by the
W8A8 GEMM must give the same hidden states as with a quantization launch before each GEMM (the
linears' `input_quant` offering no buffers) while launching a quarter of the quantizations. The
interpreter reads TRITON_INTERPRET at import, so the checks run in a fresh subprocess
(`python -m tests.integration.test_fp8_fused_quant`).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from tests.support.child import assert_interpreter_checks_pass


def test_fused_quantization_under_triton_interpreter() -> None:
    assert_interpreter_checks_pass("tests.integration.test_fp8_fused_quant", drop_env=("LORAPLEX_FP8_GEMM",))


# ---- run in the subprocess, with TRITON_INTERPRET=1 ----


def _same_quantization(name: str, out: torch.Tensor, quant) -> bool:
    """`quant` equals the separate launch's quantization of `out` byte for byte, its scales are the
    torch reference's (amax / 448), and it dequantizes to near `out`: within a quarter of the row's
    amax, as the interpreter's cast to E4M3 is not round-to-nearest (on a GPU, 1/16)."""
    from loraplex.kernels.fp8_matmul import quantize_rows
    from loraplex.kernels.fp8_quant import quantize_rows_fused

    want = quantize_rows_fused(out)
    same = torch.equal(quant.scale, want.scale) and torch.equal(
        quant.q.view(torch.int8), want.q.view(torch.int8)
    )
    scales = torch.equal(quant.scale, quantize_rows(out)[1])
    real = out.float()
    err = ((quant.q.float() * quant.scale - real).abs().amax(-1) / real.abs().amax(-1)).max().item()
    ok = same and scales and err <= 0.25 and real.abs().amax() > 0
    print(
        f"{name}: same bytes as the separate launch {same}, reference scales {scales}, rel err {err:.3f}",
        end="",
    )
    print(" ok" if ok else " FAIL")
    return ok


def _check_kernels(device: torch.device) -> int:
    from loraplex.kernels.fp8_quant import empty_quantized
    from loraplex.kernels.fused_ops import add_rms_norm, rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(11)
    failures = 0
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn((5, 100), generator=gen).to(device, dtype)
        w = torch.randn(100, generator=gen).to(device, dtype)
        for unit_offset in (False, True):
            quant = empty_quantized(5, 100, x.device)
            out = rms_norm(x, w, 1e-5, unit_offset, quant)
            failures += not _same_quantization(f"rms_norm {dtype} unit_offset {unit_offset}", out, quant)
        y = torch.randn((5, 100), generator=gen).to(device, dtype)
        delta = torch.randn((5, 100), generator=gen).to(device)
        for d in (None, delta):
            quant = empty_quantized(5, 100, x.device)
            _, out = add_rms_norm(x, y, w, 1e-5, d, quant=quant)
            failures += not _same_quantization(f"add_rms_norm {dtype} delta {d is not None}", out, quant)
        gate_up = torch.randn((3, 2 * 200), generator=gen).to(device, dtype)
        gu_delta = torch.randn((3, 2 * 200), generator=gen).to(device)
        for activation, d in (("silu", gu_delta), ("gelu_tanh", None)):
            quant = empty_quantized(3, 200, x.device)
            out = silu_and_mul(gate_up, d, activation, quant)
            failures += not _same_quantization(f"silu_and_mul {activation} {dtype}", out, quant)
    return failures


class _TorchAttention:
    """Causal attention over one sequence (the step's tokens are the whole context)."""

    def fused_store_target(self, layer: int):
        return None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        q, k, v = (
            t.transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        )
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).flatten(1)


def _check_model(device: torch.device) -> int:
    """On the CPU a float32 model (the interpreter serves it); on a GPU bf16, as the W8A8 GEMM needs."""
    from loraplex.bench.random_runner import TINY, model_config, random_model
    from loraplex.kernels import fp8_matmul
    from loraplex.kernels.placement import run_triton_on_cpu
    from loraplex.kernels.settings import reload_kernel_settings
    from loraplex.services.inference.models.context import ForwardContext
    from loraplex.services.inference.models.quantization.fp8_linear import Fp8Linear, quantize_loaded

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = quantize_loaded(random_model(model_config(TINY, 64), dtype, device))
    launches = []
    real = fp8_matmul.quantize_rows_fused

    def counted(*args, **kwargs):
        launches.append(1)
        return real(*args, **kwargs)

    fp8_matmul.quantize_rows_fused = counted
    ids = torch.tensor([3, 17, 42, 5, 99, 7], device=device)
    ctx = ForwardContext(attention=_TorchAttention(), lora=None)
    results = {}
    interpret = os.environ.get("TRITON_INTERPRET", "0")
    served_quant = Fp8Linear.input_quant
    run_triton_on_cpu(device.type == "cpu")
    reload_kernel_settings({"TRITON_INTERPRET": interpret, "LORAPLEX_FP8_GEMM": "w8a8"})
    try:
        for fused in ("0", "1"):
            # unfused: no linear offers its input's buffers, so each W8A8 GEMM quantizes x itself
            Fp8Linear.input_quant = served_quant if fused == "1" else (lambda self, x_like: None)
            launches.clear()
            with torch.inference_mode():
                positions = torch.arange(len(ids), device=device)
                results[fused] = (model(ids, positions, ctx), len(launches))
    finally:
        Fp8Linear.input_quant = served_quant
        run_triton_on_cpu(False)
        reload_kernel_settings()
        fp8_matmul.quantize_rows_fused = real
    (off, off_launches), (on, on_launches) = results["0"], results["1"]
    layers = len(model.layers)
    ok = torch.equal(on, off) and off_launches == 4 * layers and on_launches == layers and on.abs().sum() > 0
    print(
        f"decoder, W8A8 GEMM: hidden states equal {torch.equal(on, off)}, quantization launches "
        f"{off_launches} unfused, {on_launches} fused ({layers} layers) {'ok' if ok else 'FAIL'}"
    )
    return not ok


if __name__ == "__main__":
    # On a GPU (`--device cuda`, no interpreter) the same checks run the compiled kernels.
    where = torch.device(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu")
    if where.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 to run the kernels on the CPU")
    failures = _check_kernels(where) + _check_model(where)
    print("checked")
    sys.exit(1 if failures else 0)
