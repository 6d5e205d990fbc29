"""The base-step options of issue 38 (skinny GEMM with its SiLU epilogue, the fused KV store, the
direct single-split decode) under the Triton interpreter, in a child process (Triton reads
TRITON_INTERPRET at import): randomized against their torch references, bit-identical where they
only move a write, and a tiny model's greedy tokens with every option on equal to every option off.
The checks themselves: tests/support/base_step_check.py. About 30 s on one core.
"""

from __future__ import annotations

from tests.support.child import child_env, run_child


def test_base_step_options_match_their_references():
    # the child switches the options itself
    options = (
        "LORAPLEX_SKINNY_GEMM",
        "LORAPLEX_SKINNY_SILU",
        "LORAPLEX_FUSED_KV_STORE",
        "LORAPLEX_DECODE_DIRECT",
    )
    proc = run_child(["-m", "tests.support.base_step_check"], env=child_env(interpret=True, drop=options))
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count(": ok") == 19, proc.stdout  # 2 of them the FP8 cache's fused store
