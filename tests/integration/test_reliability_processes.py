"""Child servers die with their parent, even when the parent is SIGKILLed (`loraplex up`, tests).

A real parent process starts an adapter store through `loraplex.clients.processes.ServerProcess`
while it holds a live gRPC channel (the situation in which a fork-based start deadlocked),
prints the child's pid, and is then killed with SIGKILL; the store must go away by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARENT = """
import sys, time, grpc
from pathlib import Path
from loraplex.clients.processes import ServerProcess
live = grpc.insecure_channel("127.0.0.1:9")  # grpc threads are running in this parent
def store(cache):
    return ServerProcess("store", "loraplex.adapter_store", ["--port", "0", "--cache-dir", cache], echo=False)
first = store(sys.argv[1] + "/a")
first.wait_serving(60)
second = store(sys.argv[1] + "/b")
second.wait_serving(60)
print(first.proc.pid, second.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(") ", 1)[1][0] != "Z"


def test_children_die_when_the_parent_is_killed(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"parent printed {line!r}"
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
