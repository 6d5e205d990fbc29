"""Keeps `loraplex up --replicas N`'s inference replicas running: one that dies is logged and
started again on its port, with backoff, while the router sends its calls to the others.

Backoff: 1 s after the first exit, doubling to 30 s while a replica keeps dying; a replica that
stayed up for 60 s starts again from 1 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from loraplex.clients.processes import ServerProcess

log = logging.getLogger("loraplex.up")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0


class ReplicaKeeper:
    def __init__(
        self,
        replicas: list[ServerProcess],
        start: Callable[[int, int], ServerProcess],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`start(i, port)` starts replica i again on `port` (the router knows it by that port)."""
        self.replicas = replicas
        self.ports = [r.port for r in replicas]
        self._start = start
        self._clock = clock
        now = clock()
        self._started_at = [now] * len(replicas)
        self._backoff = [FIRST_BACKOFF_S] * len(replicas)
        self._due: list[float | None] = [None] * len(replicas)
        self.restarts = 0

    def check(self) -> None:
        """Notice dead replicas and start those whose backoff has passed; never blocks."""
        now = self._clock()
        for i, replica in enumerate(self.replicas):
            if self._due[i] is None:
                code = replica.proc.poll()
                if code is None:
                    continue
                if now - self._started_at[i] >= STABLE_S:
                    self._backoff[i] = FIRST_BACKOFF_S
                self._due[i] = now + self._backoff[i]
                log.error(
                    "%s exited with %s; the others serve its calls; restarting it in %.0f s",
                    replica.name,
                    code,
                    self._backoff[i],
                )
                self._backoff[i] = min(self._backoff[i] * 2, MAX_BACKOFF_S)
            due = self._due[i]
            if due is not None and now >= due:
                self._due[i] = None
                self._started_at[i] = now
                self.restarts += 1
                log.info("restarting %s on port %d", replica.name, self.ports[i])
                self.replicas[i] = self._start(i, self.ports[i])
