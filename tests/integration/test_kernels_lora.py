"""Triton LoRA shrink/expand, and DoRA's scale kernel, vs their torch references, on the CPU through
Triton's interpreter.

Triton picks interpreter or compiler when a kernel is *decorated*, and another test module
may already have imported the kernels in this pytest process, so the checks run in one
child process started with TRITON_INTERPRET=1; each case's numbers come back as JSON and
are asserted here. bf16 is not checked here (the interpreter's bf16 math is wrong, design
brief §9); the GPU benchmark checks bf16 before timing.
"""

from __future__ import annotations

import pytest

from loraplex.kernels.lora_check import CASES
from tests.support.child import child_env, json_lines, run_child

TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    proc = run_child(["-m", "loraplex.kernels.lora_check"], env=child_env(interpret=True))
    rows = json_lines(proc.stdout)
    return {row.get("name") or "segments: " + row["segments"]: row for row in rows}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(results, case):
    row = results[case.name]
    tol = TOLERANCE[case.dtype]
    assert row["shrink_rel_err"] <= tol, row
    assert row["expand_rel_err"] <= tol, row
    assert row["y_written_exactly"], "shrink wrote outside (or missed part of) the valid region"
    assert row["untouched_rows_equal"], "expand changed tokens that have no adapter"
    # Delta mode: same numbers, written (not added) for every adapter token, nothing else.
    assert row["delta_mode_rel_err"] <= tol, row
    assert row["delta_mode_adds_up"], "base + delta rounds differently from the in-place expand"
    assert row["delta_mode_untouched"], "delta mode wrote rows of tokens without an adapter"
    assert row["tight_grid_equal"], "a grid sized by the plan's distinct_bound missed token blocks"
    if case.splits is not None:
        assert row["splits"] == case.splits
    if case.slot_pattern == "none":
        assert row["delta_norm"] == 0.0
    else:
        assert row["delta_norm"] > 0.0, "case does no LoRA work: it would test nothing"


def test_decode_uses_split_k_for_wide_inputs(results):
    # d=4200 at 6 tokens: the table splits K, and expand must add the partials back up.
    assert results["down_decode_split_table_fp32"]["splits"] > 1


def test_segments_built_by_triton_match_torch(results):
    """`build_segments` on CUDA (one Triton launch) against the torch build, on the entries the kernels
    read; the kernel cases above also run over Triton-built maps."""
    seg = {k: v["match"] for k, v in results.items() if k.startswith("segments: ")}
    assert len(seg) == 11 and all(seg.values()), seg


def test_dora_scale_kernel_matches_its_reference():
    """kernels/dora_scale.py (a child of its own: tests/support/dora_scale_check.py)."""
    proc = run_child(["-m", "tests.support.dora_scale_check"], env=child_env(interpret=True))
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count(": ok") == 8, proc.stdout
