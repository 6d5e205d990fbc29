"""The base-step options of issue 38 (skinny GEMM with its SiLU epilogue, the fused KV store, the
direct single-split decode) under the Triton interpreter, in a child process (Triton reads
TRITON_INTERPRET at import): randomized against their torch references, bit-identical where they
only move a write, and a tiny model's greedy tokens with every option on equal to every option off.
The checks themselves: tests/support/base_step_check.py. About 30 s on one core.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_base_step_options_match_their_references():
    env = dict(os.environ, TRITON_INTERPRET="1")
    for name in (
        "LORAPLEX_SKINNY_GEMM",
        "LORAPLEX_SKINNY_SILU",
        "LORAPLEX_FUSED_KV_STORE",
        "LORAPLEX_DECODE_DIRECT",
    ):
        env.pop(name, None)  # the child switches them itself
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{REPO / 'protos'}"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.base_step_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout
    assert proc.stdout.count(": ok") == 19, proc.stdout  # 2 of them the FP8 cache's fused store
