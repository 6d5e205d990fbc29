"""The worker processes of one tensor-parallel engine: spawn, fan out messages, watch for death.

A monitor thread waits on every worker's process sentinel; a worker that exits while the
engine runs marks the group unhealthy at once (with a log line naming the rank, pid and exit
code) and calls `on_death`, so the server can go NOT_SERVING without waiting for a step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.parallel.worker import WorkerSpec, recv, send, worker_main

log = logging.getLogger(__name__)


class WorkerGroup:
    def __init__(self, specs: list[WorkerSpec]):
        self.specs = specs
        self.procs: list = []
        self.conns: list[Connection] = []
        self._reason: str | None = None
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self.on_death: Callable[[str], None] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        for spec in self.specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(spec, child), name=f"loraplex-tp{spec.rank}", daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        log.info("started %d tensor-parallel workers (pids %s)", len(self.procs), [p.pid for p in self.procs])

    def wait_loaded(self, timeout_s: float) -> list[int]:
        """Each worker's KV block count once its shard is loaded; raises if one fails or dies."""
        blocks = []
        for spec, proc, conn in zip(self.specs, self.procs, self.conns, strict=True):
            ready = wait([conn, proc.sentinel], timeout_s)
            if conn in ready:
                try:
                    message = recv(conn)
                except EOFError:
                    message = ("error", "it closed its pipe")
                if message[0] == "loaded":
                    blocks.append(message[1])
                    continue
                raise RuntimeError(f"tensor-parallel worker rank {spec.rank} failed to start: {message[1]}")
            if proc.sentinel in ready:
                raise RuntimeError(
                    f"tensor-parallel worker rank {spec.rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode} while loading the model"
                )
            raise RuntimeError(
                f"tensor-parallel worker rank {spec.rank} did not load within {timeout_s:.0f} s"
            )
        return blocks

    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to exit; terminate those that do not."""
        self._stopping.set()
        for conn in self.conns:
            try:
                send(conn, ("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                log.warning("TP worker %s did not stop; terminating it", proc.name)
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        if self._monitor is not None:
            self._monitor.join(2)

    # -- health -----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._reason is None and not self._stopping.is_set()

    @property
    def reason(self) -> str | None:
        """Why the group is unusable (a worker died), or None."""
        return self._reason

    def _watch(self) -> None:
        sentinels = {p.sentinel: (s, p) for s, p in zip(self.specs, self.procs, strict=True)}
        while not self._stopping.is_set():
            for sentinel in wait(list(sentinels), timeout=0.5):
                spec, proc = sentinels[sentinel]
                if self._stopping.is_set():
                    return
                proc.join(1)
                self._mark_dead(
                    f"tensor-parallel worker rank {spec.rank} (pid {proc.pid}) died with exit code "
                    f"{proc.exitcode}"
                )
                return

    def _mark_dead(self, reason: str) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        log.error(
            "%s: the engine cannot run any more steps and reports NOT_SERVING; restart the server", reason
        )
        if self.on_death is not None:
            self.on_death(reason)

    def fail(self, reason: str) -> None:
        """Rank 0 left lockstep (its part of a step failed): mark the group dead, end the workers.

        A collective usually fails because a peer died: name that worker when it has exited."""
        by_sentinel = {p.sentinel: (s, p) for s, p in zip(self.specs, self.procs, strict=True)}
        for sentinel in wait(list(by_sentinel), timeout=1.0):
            spec, proc = by_sentinel[sentinel]
            proc.join(1)
            reason = (
                f"tensor-parallel worker rank {spec.rank} (pid {proc.pid}) died with exit code "
                f"{proc.exitcode}"
            )
            break
        self._mark_dead(reason)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def check(self) -> None:
        if self._reason is not None:
            raise BackendUnavailable(f"{self._reason}; the server must be restarted")
        if self._stopping.is_set():
            raise BackendUnavailable("the tensor-parallel workers are shut down")

    # -- messages (engine thread; uploads may come from the manager under its lock) -----------

    def broadcast(self, message: tuple) -> None:
        self.check()
        for spec, conn in zip(self.specs, self.conns, strict=True):
            self._send(spec.rank, conn, message)

    def send_upload(self, rank: int, slot: int, shard) -> None:
        self.check()
        self._send(rank, self.conns[rank - 1], ("lora", slot, shard))

    def _send(self, rank: int, conn: Connection, message: tuple) -> None:
        try:
            with self._send_lock:
                send(conn, message)
        except OSError as exc:
            self.fail(f"tensor-parallel worker rank {rank} is unreachable ({exc})")
            raise BackendUnavailable(f"{self._reason}; the server must be restarted") from exc
