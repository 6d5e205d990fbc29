"""Children: a module or script run afresh in its own process from the repository root.

Tests start a child where the parent's process cannot host the check: Triton reads TRITON_INTERPRET at
import (so interpreter checks need it set, and compile checks need it gone), kernel settings are read
once per process, and benches run the one way users run them (`python -m loraplex.bench.X`).

A test marked `early_child(argv, **child_env_kwargs)` has its child started as soon as collection
ends (tests/conftest.py), in the background, one such child at a time: the session's own process keeps
one core busy, the child the other, and the test then only collects the child's result. A Triton
interpreter check takes seconds of CPU that the unit tier's wall time no longer pays in full."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


def _run(argv: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """`python *argv` from the repository root, to its end (killed past `timeout` seconds)."""
    with subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        with _lock:
            _running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _lock:
                _running.discard(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# Children started early: (argv, env) -> the future of their CompletedProcess. One thread runs
# them in the order asked, one at a time (a second would contend with the session for its core).
_early: dict[tuple, Future] = {}
_early_runner: ThreadPoolExecutor | None = None
_running: set[subprocess.Popen] = set()
_lock = threading.Lock()


# Variables the session sets after collection, no difference between two children: pytest names the
# running test in PYTEST_CURRENT_TEST; torch's inductor exports its default cache directory (the one a
# child computes for itself).
_SET_BY_THE_SESSION = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


def _key(argv: list[str], env: dict[str, str]) -> tuple:
    return tuple(argv), tuple(sorted(kv for kv in env.items() if kv[0] not in _SET_BY_THE_SESSION))


def start_early(argv: list[str], env: dict[str, str], timeout: int = 300) -> None:
    """Start `python *argv` (with `env`) in the background now, for the `run_child` call with the same
    argv and env to collect. A call with a different env (say a test changed os.environ) runs its
    own child instead, so what a test checks is always what it asked for."""
    global _early_runner
    key = _key(argv, env)
    if key in _early:
        return
    if _early_runner is None:
        _early_runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="early-child")
    _early[key] = _early_runner.submit(_run, list(argv), dict(env), timeout)


def stop_early() -> None:
    """The session is over: children started early that no test collected are not waited for."""
    global _early_runner
    for future in _early.values():
        future.cancel()
    _early.clear()
    with _lock:
        for proc in _running:
            proc.kill()
    if _early_runner is not None:
        _early_runner.shutdown(wait=True)
        _early_runner = None


def run_child(argv: list[str], *, env: dict[str, str] | None = None, timeout: int = 300):
    """Run `python *argv` from the repository root (or collect the run `start_early` started); it
    must exit 0, else the test fails showing the tails of both streams. Returns the CompletedProcess
    (text output)."""
    env = child_env() if env is None else env
    early = _early.pop(_key(argv, env), None)
    proc = early.result() if early is not None else _run(argv, env, timeout)
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
