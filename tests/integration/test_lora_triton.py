"""TritonLoRABackend equals TorchLoRABackend on one mixed pool (Triton's CPU interpreter, child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DTYPES = {"float32": 1e-5, "float16": 2e-2}  # dtype -> tolerance


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """backend_check's cases for every dtype, from one child process: dtype -> results."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "backend_check_dtypes.py"), *DTYPES],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out.setdefault(r["dtype"].removeprefix("torch."), []).append(r)
    return out


@pytest.mark.parametrize("dtype, tol", DTYPES.items())
def test_triton_backend_matches_torch_backend(results, dtype, tol):
    assert len(results.get(dtype, [])) == 4, results.keys()
    for r in results[dtype]:
        assert r["rel_err"] < tol, r
        assert r["side_stream_equal"], r
