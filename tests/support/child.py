"""Children: a module or script run afresh in its own process from the repository root.

Tests start a child where the parent's process cannot host the check: Triton reads TRITON_INTERPRET at
import (so interpreter checks need it set, and compile checks need it gone), kernel settings are read
once per process, and benches run the one way users run them (`python -m loraplex.bench.X`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHONPATH = f"{REPO}{os.pathsep}{REPO / 'protos'}"  # `tests.support` and the `loraplex` namespace


def child_env(*, interpret: bool | None = None, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a child: the repo's PYTHONPATH; TRITON_INTERPRET=1 when
    `interpret`, removed when `interpret is False` (kernels decorated under it do not compile); the
    `drop` variables removed (settings the child switches itself); then `extra` set."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    elif interpret is False:
        env.pop("TRITON_INTERPRET", None)
    for name in drop:
        env.pop(name, None)
    env.update(extra)
    return env


def run_child(argv: list[str], *, env: dict[str, str] | None = None, timeout: int = 300):
    """Run `python *argv` from the repository root; it must exit 0, else the test fails showing the
    tails of both streams. Returns the CompletedProcess (text output)."""
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env=child_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"python {' '.join(argv)} exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return proc


def json_lines(stdout: str) -> list[dict]:
    """The JSON objects a check child printed, one per line starting with `{`."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def last_json(stdout: str) -> dict:
    """The JSON object on a child's last line of output."""
    return json.loads(stdout.strip().splitlines()[-1])


def assert_interpreter_checks_pass(module: str, drop_env: tuple[str, ...] = (), timeout: int = 300) -> str:
    """Run `python -m module` under TRITON_INTERPRET=1 (without the `drop_env` variables, which the
    child sets itself); it must exit 0, print "checked" and no "FAIL". Returns its stdout."""
    proc = run_child(["-m", module], env=child_env(interpret=True, drop=drop_env), timeout=timeout)
    assert "checked" in proc.stdout and "FAIL" not in proc.stdout, proc.stdout
    return proc.stdout
