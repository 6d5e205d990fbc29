"""Interpreter checks in a child process: Triton reads TRITON_INTERPRET at import, so a test module
whose `__main__` runs its kernels on the CPU is started afresh with the variable set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_interpreter_checks_pass(module: str, drop_env: tuple[str, ...] = (), timeout: int = 300) -> str:
    """Run `python -m module` under TRITON_INTERPRET=1 (without the `drop_env` variables, which the
    child sets itself); it must exit 0, print "checked" and no "FAIL". Returns its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}"}
    for name in drop_env:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr}"
    assert "checked" in proc.stdout and "FAIL" not in proc.stdout, proc.stdout
    return proc.stdout
