"""Every GPU benchmark's variants, end to end at a tiny size on CUDA: a bench variant that swaps a
buffer some captured graph reads, or forgets a graph kind when it recaptures, dies here with an
illegal memory access instead of in the middle of a measurement run. (On the GPU machine:
`python3 -m pytest -m gpu tests/integration/test_gpu_bench_smoke.py`.)"""

from __future__ import annotations

import json

import pytest

from tests.support.child import run_child

pytestmark = pytest.mark.gpu

BENCHES = {
    # name: arguments for a tiny run that still reaches every variant the full run has
    "serving": ["--tiny", "--adapters", "8"],
    "mixed_step": ["--tiny", "--device", "cuda"],
    "prefix_cache": ["--mode", "gpu", "--tiny"],
    "fp8_kv": ["--tiny", "--device", "cuda"],
    "fp8_gemm": ["--tiny", "--sweep-budget-s", "5", "--step-repeats", "3"],
    "fp8_step": [
        "--tiny",
        "--device",
        "cuda",
        "--skip-quality",
        "--fp8-variant",
        "LORAPLEX_FP8_GEMM=scaled_mm",
        "--fp8-variant",
        "LORAPLEX_FP8_GEMM=weight_only",
        "--variant-adapters",
    ],
}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_runs_end_to_end_on_cuda(bench, tmp_path):
    run_child(["-m", f"loraplex.bench.{bench}", *BENCHES[bench], "--out", str(tmp_path)], timeout=900)
    assert json.loads((tmp_path / f"{bench}.json").read_text())
