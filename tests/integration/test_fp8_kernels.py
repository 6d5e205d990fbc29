"""The FP8 kernels (kernels/fp8_quant.py, kernels/fp8_matmul.py) against their torch references.

The Triton kernel runs on the CPU under TRITON_INTERPRET=1, which Triton reads at import, so the
interpreter checks run in a fresh subprocess (`python -m tests.integration.test_fp8_kernels`).
The interpreter's cast to E4M3 does not round to nearest, so its inputs lie on the E4M3 grid
(times a power-of-two scale, so dividing by it is exact): there every correct quantizer gives the same bytes.
"""

from __future__ import annotations

import os
import sys

import torch

from loraplex.kernels.fp8_matmul import FP8_DTYPE, dequantize, expand_scale, quantize_rows
from tests.support.child import assert_interpreter_checks_pass


def on_grid(rows: int, cols: int, seed: int, scale: float = 2.0**-6) -> torch.Tensor:
    """Values `e4m3 * scale` with every row's amax exactly 448 * scale."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-126, 127, (rows, cols), generator=gen).to(torch.int8).view(FP8_DTYPE).float()
    codes = codes.nan_to_num(0.0)
    codes[:, 0] = 448.0
    return codes * scale


def test_quantize_rows_reference_rounds_to_nearest_with_amax_over_448():
    x = torch.tensor([[1.0, -0.5, 0.3], [0.0, 0.0, 0.0]])
    q, s = quantize_rows(x)
    assert torch.allclose(s[0], torch.tensor(1.0 / 448)) and s[1].item() > 0
    assert q[0, 0].float().item() == 448.0 and q[1].float().abs().sum() == 0
    # 0.3 * 448 = 134.4: E4M3 has 128, 144 there (spacing 16): nearest is 128.
    assert q[0, 2].float().item() == 128.0


def test_block_scales_expand_over_partial_blocks():
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    full = expand_scale(scale, (3, 5), (2, 3))
    assert full.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]]
    w = torch.ones(3, 5, dtype=FP8_DTYPE)
    assert torch.equal(dequantize(w, scale, (2, 3), torch.float32), full)


def test_torch_attention_over_an_fp8_cache_equals_a_float_cache_of_the_same_values():
    """The FP8 cache changes only what is stored: attention over it equals attention over a float32
    cache holding the same E4M3-rounded (and saturated) k/v."""
    from loraplex.services.inference.engine.attention import (
        AttentionMetadata,
        PrefillSegment,
        TorchPagedAttention,
    )

    gen = torch.Generator().manual_seed(0)
    t, heads, kv_heads, dim, page = 10, 4, 2, 16, 4
    q = torch.randn(t, heads, dim, generator=gen)
    k = torch.randn(t, kv_heads, dim, generator=gen) * 100  # some beyond 448: saturated, not NaN
    v = torch.randn(t, kv_heads, dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
        decode_context_lens=torch.zeros(0, dtype=torch.int64),
        prefill_segments=[PrefillSegment(0, t, 0, t)],
        prefill_ctx_slots=torch.arange(t),
    )
    outs = []
    for dtype, kk, vv in (
        (FP8_DTYPE, k, v),
        (torch.float32, k.clamp(-448, 448).to(FP8_DTYPE).float(), v.to(FP8_DTYPE).float()),
    ):
        attn = TorchPagedAttention(torch.zeros(1, 2, 4, page, kv_heads, dim, dtype=dtype), dim**-0.5)
        attn.begin(meta)
        outs.append(attn.forward(0, q, kk, vv))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_kernels_under_triton_interpreter() -> None:
    assert_interpreter_checks_pass("tests.integration.test_fp8_kernels")


# ---- run in the subprocess, with TRITON_INTERPRET=1 ----


def _interpreter_checks() -> int:
    from loraplex.kernels.fp8_matmul import fp8_linear_mm, fp8_linear_ref
    from loraplex.kernels.fp8_quant import quantize_rows_fused
    from loraplex.kernels.placement import run_triton_on_cpu

    failures = 0
    # One pass up to ONE_PASS_MAX columns; two passes of 1,024 above (the last case).
    for rows, cols, dtype in (
        (5, 200, torch.float32),
        (3, 64, torch.float16),
        (1, 1030, torch.float32),
        (2, 16500, torch.float32),
    ):
        x = on_grid(rows, cols, seed=cols).to(dtype)
        q, s = quantize_rows_fused(x)
        rq, rs = quantize_rows(x)
        ok = torch.equal(s, rs) and torch.equal(q.view(torch.int8), rq.view(torch.int8))
        failures += not ok
        print(f"quantize_rows_fused {rows}x{cols} {dtype}: {'ok' if ok else 'FAIL'}")
    run_triton_on_cpu(True)
    try:
        x = on_grid(16, 64, seed=1)
        w, ws = quantize_rows(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
        try:
            out = fp8_linear_mm(x, w, ws.reshape(1, -1).contiguous())
        except (RuntimeError, NotImplementedError) as exc:
            print(f"fp8_linear_mm: torch._scaled_mm does not run on this CPU ({exc}); skipped")
        else:
            # x is exact in E4M3, so the only difference left is the bf16 output rounding.
            ref = fp8_linear_ref(x, w, ws, None)
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            ok = err < 1e-2
            failures += not ok
            print(f"fp8_linear_mm vs reference: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    finally:
        run_triton_on_cpu(False)
    print("checked")
    return failures


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("set TRITON_INTERPRET=1 to run the kernels on the CPU")
    sys.exit(1 if _interpreter_checks() else 0)
