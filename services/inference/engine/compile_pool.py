"""CompilePool: runs grammar compiles on worker threads, fairly across callers, each under a time
limit that measures the compile itself, never its wait in the queue.

Why its own scheduling (not a ThreadPoolExecutor): a compile cannot be interrupted (xgrammar runs
it in C++), so one caller's slow grammars could otherwise fill every worker and make every other
caller's grammar wait, time out on that wait, and be refused.

- `workers` compiles run at once. A caller (`owner`: the servicer's call id) runs at most
  `per_owner` at once; its other compiles wait while other callers' compiles pass them (the queue
  is round-robin over callers).
- A compile's time limit starts when a worker starts it. Past it, its job fails with the error
  `on_overdue` builds and gives its worker slot back (up to `max_overdue` such compiles at once,
  so the threads stay bounded); the compile finishes in the background and its result is dropped.
- A job is shared by every caller that asked for the same key. A caller that leaves only removes
  itself: a job nobody waits for any more is dropped if it has not started; a started job is left
  to finish (its result is worth keeping).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.services.inference.errors import BackendUnavailable, CapacityExceeded

COMPILE_WORKERS = 2  # compiles running at once within their time limit
PER_OWNER = 1  # compiles one caller may run at once
MAX_OVERDUE = 2  # compiles past their limit that may run on in the background, on top of the workers
MAX_QUEUED = 256  # compiles waiting for a worker; beyond that a new one is refused (retry later)


@dataclass(eq=False)
class CompileJob:
    key: Any
    run: Callable[[], Any]
    owner: str
    context: Any = None  # what the submitter attached (the constraint), for its callbacks
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: int = 1
    started: float | None = None  # time.monotonic() when a worker took it
    overdue: bool = False
    holds_slot: bool = False  # it counts against `workers`
    done: bool = False


class CompilePool:
    """`submit(key, run, owner)` -> a shared CompileJob; `leave(job)` when a waiter gives up.

    `on_result(job, value_or_exc)` runs on the worker (under no lock) when a compile ends in time
    and returns what the job's future gets (a value, or an exception to raise); `on_overdue(job)`
    returns the exception the job's waiters get when its compile outlasts `timeout_s`."""

    def __init__(
        self,
        timeout_s: float,
        on_result: Callable[[CompileJob, Any], Any],
        on_overdue: Callable[[CompileJob], BaseException],
        *,
        workers: int = COMPILE_WORKERS,
        per_owner: int = PER_OWNER,
        max_overdue: int = MAX_OVERDUE,
        max_queued: int = MAX_QUEUED,
    ):
        self.timeout_s = timeout_s
        self._on_result, self._on_overdue = on_result, on_overdue
        self.workers, self.per_owner, self.max_overdue, self.max_queued = (
            workers,
            per_owner,
            max_overdue,
            max_queued,
        )
        self._lock = threading.Lock()
        self._jobs: dict[Any, CompileJob] = {}  # by key: queued or running (not yet overdue)
        self._queues: OrderedDict[str, deque[CompileJob]] = OrderedDict()  # by owner, round-robin
        self._running: dict[str, int] = {}  # by owner, overdue ones included
        self._slots_used = 0
        self._overdue = 0
        self._closed = False

    # -- callers ----------------------------------------------------------------------------

    def submit(self, key, run: Callable[[], Any], owner: str, context: Any = None) -> CompileJob:
        with self._lock:
            job = self._jobs.get(key)
            if job is not None:
                job.waiters += 1
                return job
            queued = sum(len(q) for q in self._queues.values())
            if queued >= self.max_queued:
                raise CapacityExceeded(f"{queued} grammar compiles are queued; retry later")
            job = self._jobs[key] = CompileJob(key, run, owner, context)
            self._queues.setdefault(owner, deque()).append(job)
            self._dispatch()
            return job

    def leave(self, job: CompileJob) -> None:
        """One waiter of `job` gives up: a queued job nobody waits for is dropped."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.started is not None:
                return
            queue = self._queues.get(job.owner)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.owner]
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]

    def queued_ahead(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def idle(self) -> bool:
        """Nothing queued and no compile thread running (overdue ones included)."""
        with self._lock:
            return not self._queues and not self._running

    def close(self) -> None:
        """Start nothing more; queued compiles fail now (running ones end on their own)."""
        with self._lock:
            self._closed = True
            queued = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            for job in queued:
                self._jobs.pop(job.key, None)
        for job in queued:
            job.future.set_exception(BackendUnavailable("the engine shut down"))

    # -- scheduling (under the lock) ---------------------------------------------------------

    def _dispatch(self) -> None:
        while not self._closed and self._slots_used < self.workers:
            job = self._next_job()
            if job is None:
                return
            job.started = time.monotonic()
            job.holds_slot = True
            self._slots_used += 1
            self._running[job.owner] = self._running.get(job.owner, 0) + 1
            timer = threading.Timer(self.timeout_s, self._expire, (job,))
            timer.daemon = True
            thread = threading.Thread(target=self._work, args=(job, timer), name="grammar", daemon=True)
            thread.start()
            timer.start()

    def _next_job(self) -> CompileJob | None:
        """The first queued job, in round-robin order of owners, whose owner may run another."""
        for owner, queue in self._queues.items():
            if self._running.get(owner, 0) < self.per_owner:
                job = queue.popleft()
                del self._queues[owner]
                if queue:
                    self._queues[owner] = queue  # to the back of the round
                return job
        return None

    def _release(self, job: CompileJob) -> None:
        """`job`'s compile thread ends (in time or overdue)."""
        left = self._running[job.owner] - 1
        if left:
            self._running[job.owner] = left
        else:
            del self._running[job.owner]
        if job.holds_slot:
            self._slots_used -= 1
        elif job.overdue:
            self._overdue -= 1
        self._dispatch()

    # -- workers -----------------------------------------------------------------------------

    def _work(self, job: CompileJob, timer: threading.Timer) -> None:
        try:
            value: Any = job.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            value = exc
        timer.cancel()
        with self._lock:
            in_time = not job.overdue
            job.done = True
        outcome = None
        try:
            if in_time:  # (an overdue result is dropped: its waiters were already refused)
                outcome = self._on_result(job, value)  # kept in the cache before the job leaves
        except Exception as exc:  # noqa: BLE001 - a bug in the callback still frees the worker
            outcome = exc
        finally:
            with self._lock:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                self._release(job)
        if in_time:
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _expire(self, job: CompileJob) -> None:
        with self._lock:
            if job.done:
                return
            job.overdue = True
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
        # Its waiters are refused before its worker slot can go to the next job (a loaded machine
        # could otherwise run that job to its end first).
        job.future.set_exception(self._on_overdue(job))
        with self._lock:
            if not job.done and job.holds_slot and self._overdue < self.max_overdue:
                # Its worker slot goes to the queue; the thread runs on, counted apart.
                job.holds_slot = False
                self._slots_used -= 1
                self._overdue += 1
                self._dispatch()
