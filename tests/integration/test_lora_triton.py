"""TritonLoRABackend equals TorchLoRABackend on one mixed pool (Triton's CPU interpreter, child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2)])
def test_triton_backend_matches_torch_backend(dtype, tol):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.services.inference.lora.backend_check", "--dtype", dtype],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 4
    for r in results:
        assert r["rel_err"] < tol, r
        assert r["side_stream_equal"], r
