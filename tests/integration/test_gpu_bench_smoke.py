"""Every benchmark suite end to end at a tiny size on CUDA, and the goals command: a suite that swaps a
buffer some captured graph reads, or forgets a graph kind when it recaptures, dies here with an illegal
memory access instead of in the middle of a measurement run, and the goal table's GPU-only rows get a
number. (On the GPU machine: `python3 -m pytest -m gpu tests/integration/test_gpu_bench_smoke.py`.)"""

from __future__ import annotations

import json

import pytest

from tests.support.child import run_child

pytestmark = pytest.mark.gpu

BENCHES = {
    # name: arguments for a tiny run that still reaches every part the full run has
    "step": ["--tiny", "--device", "cuda"],
    "kernels": ["--tiny"],
    "mixed_graph_check": ["--device", "cuda"],
    "fp8_gemm": ["--tiny", "--sweep-budget-s", "5"],
    "adapter_kinds": ["--tiny", "--device", "cuda"],
    "speculation": ["--tiny", "--device", "cuda"],
    "workload": ["--mode", "engine", "--tiny", "--window", "2", "--drain", "20", "--rate", "15"]
    + ["--prompt-len", "8,24", "--output-len", "4,12", "--scenarios", "base", "zipf:8:pool=2", "zipf:8"],
}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_suite_runs_end_to_end_on_cuda(bench, tmp_path):
    run_child(["-m", f"loraplex.bench.{bench}", *BENCHES[bench], "--out", str(tmp_path)], timeout=900)
    assert json.loads((tmp_path / f"{bench}.json").read_text())


def test_adapter_kinds_graph_equals_eager_on_cuda():
    """The decode graphs' kinds variant (DoRA, embedding / lm_head LoRA, trainable tokens beside plain
    adapters and the base) against the eager step (bench/adapter_kinds.py --check)."""
    argv = ["-m", "loraplex.bench.adapter_kinds", "--check", "--tiny", "--device", "cuda"]
    out = run_child(argv, timeout=900).stdout
    assert "variant replayed: True -> OK" in out, out


def test_goals_fill_every_built_row_on_cuda(tmp_path):
    args = ["--tiny", "--workdir", str(tmp_path / "files"), "--out", str(tmp_path)]
    run_child(["-m", "loraplex.bench.goals", *args], timeout=900)
    rows = json.loads((tmp_path / "goals.json").read_text())["rows"]
    for r in rows:
        if r["measure"] is None:
            assert r["status"] == "not built", r
        else:  # CUDA measures every built row, the floors and the LoRA layer included
            assert r["status"] in ("met", "missed") and r["value"] > 0, r
