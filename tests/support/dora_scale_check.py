"""Child of tests/integration/test_kernels_lora.py (TRITON_INTERPRET=1): kernels/dora_scale.py's
kernel against its torch reference over random inputs (with and without a handed-over delta and a
bias, float32 and bfloat16, a width that is not a multiple of the block). One line per case, ": ok"
or "FAIL"."""

from __future__ import annotations

import itertools

import torch

from loraplex.kernels.dora_scale import dora_scale, dora_scale_ref


def within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bfloat16 results one unit in the last place apart at most (the interpreter's rounding)."""
    return bool(((got.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-6).all())


def main() -> int:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    failed = 0
    for dtype, has_delta, has_bias in itertools.product(
        (torch.float32, torch.bfloat16), (False, True), (False, True)
    ):
        T, N, rows = 5, 1100, 4
        out = torch.randn(T, N, generator=gen).to(dtype)
        table = 1 + 0.1 * torch.randn(rows, N, generator=gen)
        table[-1] = 1.0  # the row of ones
        index = torch.tensor([0, 3, 2, 3, 1, 0, 0])  # longer than T: only its first T are read
        delta = torch.randn(T, N + 8, generator=gen)[:, :N] if has_delta else None  # a strided view
        bias = torch.randn(N, generator=gen).to(dtype) if has_bias else None
        want = dora_scale_ref(out.clone(), delta, bias, table, index)
        got = dora_scale(out.clone(), delta, bias, table, index)
        ok = torch.equal(got, want) if dtype == torch.float32 else within_an_ulp(got, want)
        # the in-place reference is the definition: f * (out - b + delta) + b
        y = out.float() - (bias.float() if has_bias else 0) + (delta if has_delta else 0)
        y = y * table[index[:T]] + (bias.float() if has_bias else 0)
        ok = ok and torch.equal(want, y.to(dtype))
        name = f"dora_scale {str(dtype)[6:]} delta={has_delta} bias={has_bias}"
        print(f"{name}: {'ok' if ok else 'FAIL'}", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
