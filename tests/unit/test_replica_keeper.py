"""`loraplex up --replicas N` keeps its replicas (issue 32, item 7): a dead one is logged and
started again on its own port with growing backoff; the others are left alone. Real child
processes (a sleeping python), a test clock for the backoff."""

from __future__ import annotations

import logging
import sys

from loraplex.clients.processes import ServerProcess
from loraplex.clients.replica_keeper import FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_S, ReplicaKeeper


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sleeper(i: int, port: int) -> ServerProcess:
    return ServerProcess(
        f"replica-{i}",
        "",
        ["-c", "import time; time.sleep(60)"],
        program=sys.executable,
        address=f"127.0.0.1:{port}",
        echo=False,
    )


def test_a_dead_replica_is_restarted_on_its_port_with_backoff(caplog):
    clock = Clock()
    started: list[tuple[int, int]] = []

    def start(i: int, port: int) -> ServerProcess:
        started.append((i, port))
        return sleeper(i, port)

    replicas = [sleeper(0, 40001), sleeper(1, 40002)]
    keeper = ReplicaKeeper(list(replicas), start, clock)
    try:
        keeper.check()
        assert started == []
        replicas[0].proc.kill()
        replicas[0].proc.wait()
        with caplog.at_level(logging.INFO, "loraplex.up"):
            keeper.check()
            assert "replica-0 exited" in caplog.text and "restarting it in 1 s" in caplog.text
            assert started == []  # not before its backoff
            clock.now += FIRST_BACKOFF_S
            keeper.check()
        assert started == [(0, 40001)] and keeper.replicas[1] is replicas[1]
        assert keeper.replicas[0].proc.poll() is None
        # Dies again at once: the wait doubles.
        keeper.replicas[0].proc.kill()
        keeper.replicas[0].proc.wait()
        keeper.check()
        clock.now += FIRST_BACKOFF_S
        keeper.check()
        assert len(started) == 1
        clock.now += FIRST_BACKOFF_S
        keeper.check()
        assert started[-1] == (0, 40001) and len(started) == 2
        # Up for a while: the next death waits the first backoff again.
        clock.now += STABLE_S
        keeper.replicas[0].proc.kill()
        keeper.replicas[0].proc.wait()
        keeper.check()
        clock.now += FIRST_BACKOFF_S
        keeper.check()
        assert len(started) == 3 and keeper.restarts == 3
        assert MAX_BACKOFF_S >= FIRST_BACKOFF_S
    finally:
        for r in {*replicas, *keeper.replicas}:
            r.stop(timeout=5)
