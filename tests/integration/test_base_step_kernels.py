"""The base decode step's fused launches of issue 38 (the skinny gated GEMM with its SiLU / GeGLU
epilogue, the fused KV store, the direct single-split decode), on wherever Triton runs, under the
Triton interpreter in a child process (Triton reads TRITON_INTERPRET at import): randomized against
their torch references, bit-identical where they only move a write, and a tiny model's greedy tokens
on the Triton path equal to the torch path's. The checks themselves: tests/support/base_step_check.py.
"""

from __future__ import annotations

from tests.support.child import child_env, run_child


def test_base_step_launches_match_their_references():
    proc = run_child(["-m", "tests.support.base_step_check"], env=child_env(interpret=True))
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count(": ok") == 18, proc.stdout  # 2 of them the FP8 cache's fused store
