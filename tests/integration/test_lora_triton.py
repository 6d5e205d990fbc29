"""TritonLoRABackend equals TorchLoRABackend on one mixed pool (Triton's CPU interpreter, child process)."""

from __future__ import annotations

import json

import pytest

from tests.support.child import REPO, child_env, run_child

DTYPES = {"float32": 1e-5, "float16": 2e-2}  # dtype -> tolerance


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    """backend_check's cases for every dtype, from one child process: dtype -> results."""
    script = str(REPO / "tests" / "support" / "backend_check_dtypes.py")
    proc = run_child([script, *DTYPES], env=child_env(interpret=True), timeout=600)
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
