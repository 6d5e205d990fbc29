"""A request whose values turn NaN cannot reach another request's rows (issue 59, H3 (b)), on the CUDA
path's kernels (Triton paged attention, fused ops, the Triton LoRA backend) under Triton's CPU
interpreter, in a child process (tests/support/nan_containment_check.py)."""

from __future__ import annotations

from tests.support.child import REPO, child_env, run_child


def test_nan_slot_and_stale_pages_stay_in_their_rows_on_the_triton_path():
    script = str(REPO / "tests" / "support" / "nan_containment_check.py")
    proc = run_child([script, "triton"], env=child_env(interpret=True), timeout=600)
    for model in ("llama", "mixtral"):
        assert f"{model} triton: contained ok" in proc.stdout, proc.stdout
    assert "checked" in proc.stdout and "FAIL" not in proc.stdout, proc.stdout
