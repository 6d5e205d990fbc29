"""bench/fp8_step.py's kernel-setting variants at the tiny CPU size: `--fp8-variant` adds an FP8 base
row per variant, `--variant-adapters` an FP8 + adapters row beside it with its ratios, each reading
the bytes of the default row it is compared with."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.child import run_child


def run_bench(tmp_path: Path, *extra: str) -> dict:
    args = ["--tiny", "--device", "cpu", "--skip-quality", "--repeats", "2", "--out", str(tmp_path), *extra]
    run_child(["-m", "loraplex.bench.fp8_step", *args])
    return json.loads((tmp_path / "fp8_step.json").read_text())


def test_variant_adapters_add_a_row_per_variant_beside_its_default(tmp_path):
    variant = "LORAPLEX_FP8_GEMM=weight_only"
    steps = run_bench(tmp_path, "--fp8-variant", variant, "--variant-adapters")["steps"]
    by_case = {s["case"]: s for s in steps}
    base, lora = by_case[f"fp8 base, {variant}"], by_case[f"fp8 base + 4 adapters, {variant}"]
    assert len(steps) == 6
    assert base["read_gb"] == by_case["fp8 base"]["read_gb"]
    assert lora["read_gb"] == by_case["fp8 base + 4 adapters"]["read_gb"] > base["read_gb"]
    assert lora["x_fp8_default"] == lora["ms"] / by_case["fp8 base + 4 adapters"]["ms"]
    assert lora["adapters_over_base"] == base["ms"] / lora["ms"]


def test_variants_without_adapters_time_the_base_only(tmp_path):
    steps = run_bench(tmp_path, "--fp8-variant", "LORAPLEX_FP8_GEMM=scaled_mm")["steps"]
    assert [s["case"] for s in steps[4:]] == ["fp8 base, LORAPLEX_FP8_GEMM=scaled_mm"]
    assert "adapters_over_base" not in steps[4]
