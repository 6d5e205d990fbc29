"""Adapter chat templates rendered in worker processes, with a time and a size budget.

An adapter's template is the adapter author's code: two nested `range(100000)` loops run for
hours, and a thread cannot be stopped once it runs them (it held the tokenizer lock every request
takes, and kept the process alive after SIGTERM). So an adapter's template is rendered in a small
worker process (engine/template_worker.py: transformers' sandboxed jinja renderer, no torch, its
address space capped). The worker interrupts a render at `timeout_s` itself (so one orphaned by
a killed server exits too), is killed if it has not answered `KILL_GRACE_S` later (a long C-level
step), and every worker is killed on shutdown. The model's own template (the operator's) is
rendered in-process.

Workers start on the first adapter template (about a second, not counted in the budget) and are
reused; at most `workers` render at once, and a render waits at most `WORKER_WAIT_S` for one
(RESOURCE_EXHAUSTED after that): the caller's thread is one of the server's few worker threads,
which a flood of slow templates must not all hold.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from loraplex.services.inference.errors import BackendUnavailable, CapacityExceeded, InvalidRequest

log = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 5.0  # a real template renders in milliseconds
RENDER_WORKERS = 2
WORKER_MEMORY_BYTES = 2 << 30  # address space of a worker (its libraries take about a quarter)
WORKER_START_S = 60.0
KILL_GRACE_S = 1.0  # after the budget, for the worker to stop the render itself
WORKER_WAIT_S = 1.0  # for a free worker (renders take milliseconds: only slow templates hold one)
_WORKER_MODULE = f"{__package__}.template_worker"


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _WORKER_MODULE, str(WORKER_MEMORY_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""

    def send(self, request: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict | None:
        """The next answer, or None when the deadline passes first. EOFError: the worker died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class TemplateRenderer:
    """Renders chat templates in killable worker processes (thread-safe; blocking)."""

    def __init__(self, workers: int = RENDER_WORKERS, timeout_s: float = RENDER_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._free = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def render(
        self,
        template: str,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        variables: dict,
        max_chars: int,
        what: str,
    ) -> str:
        """The template's text for `messages`. InvalidRequest (naming `what`) when it refuses them,
        runs past `timeout_s` or renders more than `max_chars`; CapacityExceeded when every worker
        stayed busy for WORKER_WAIT_S; BackendUnavailable once closed."""
        if not self._free.acquire(timeout=min(WORKER_WAIT_S, self.timeout_s)):
            raise CapacityExceeded(f"{what}: every chat-template worker is busy; retry later")
        try:
            worker = self._take()
            request = {
                "template": template,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "variables": variables,
                "max_chars": max_chars,
                "timeout_s": self.timeout_s,
            }
            try:
                worker.send(request)
                # The worker interrupts itself at timeout_s; killed if it has not answered soon after.
                answer = worker.receive(time.monotonic() + self.timeout_s + KILL_GRACE_S)
            except (OSError, EOFError, ValueError):
                answer = {"error": "its renderer died (out of memory?)", "kind": "died"}
            if answer is None or answer.get("kind") == "died":
                self._discard(worker)
                if self._closed:
                    raise BackendUnavailable("the engine is shutting down") from None
                if answer is None:
                    log.warning("%s: rendering ran past %.1f s; its worker was killed", what, self.timeout_s)
                    raise InvalidRequest(
                        f"{what} ran past its {self.timeout_s:g} s rendering budget", field="messages"
                    )
            else:
                self._give_back(worker)
            if "text" in answer:
                return answer["text"]
            if answer["kind"] == "overtime":
                raise InvalidRequest(
                    f"{what} ran past its {self.timeout_s:g} s rendering budget", field="messages"
                )
            if answer["kind"] == "refused":
                raise InvalidRequest(f"{what} refused these messages: {answer['error']}", field="messages")
            raise InvalidRequest(f"{what} cannot render these messages: {answer['error']}", field="messages")
        finally:
            self._free.release()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise BackendUnavailable("the engine is shutting down")
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    self._busy.add(worker)
                    return worker
                worker.kill()
            worker = _Worker()
            self._busy.add(worker)
        ready = None
        try:
            ready = worker.receive(time.monotonic() + WORKER_START_S)
        except (EOFError, ValueError):
            pass
        if not ready or not ready.get("ready"):
            self._discard(worker)
            if self._closed:
                raise BackendUnavailable("the engine is shutting down")
            raise BackendUnavailable("the chat-template worker did not start")
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker; renders under way end with BackendUnavailable."""
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
