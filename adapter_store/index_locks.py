"""The index's per-name registration locks (`P lock:<name>`, index_schema.py): held across a
fetch, kept alive while it runs, released even when Redis refuses for a while.

A mixin of `AdapterIndex` (index.py), which owns the client, the prefix and the lock timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

log = logging.getLogger(__name__)


class NameLocks:
    """`name_lock(name)`: one registration (or delete, or re-fetch) of a name at a time, across
    store processes sharing the Redis."""

    r: aioredis.Redis
    p: str
    lock_timeout_s: float
    _releasing: set[asyncio.Task]  # lock releases retried after a refusal

    @contextlib.asynccontextmanager
    async def name_lock(self, name: str, wait_s: float = 600.0) -> AsyncIterator[None]:
        """Hold `lock:<name>`; a background task extends it so long downloads keep it."""
        lock = Lock(
            self.r, f"{self.p}lock:{name}", timeout=self.lock_timeout_s, sleep=0.05, blocking_timeout=wait_s
        )
        if not await lock.acquire():
            raise TimeoutError(f"waited {wait_s}s for the registration lock of {name!r}")
        keeper = asyncio.create_task(self._keep(lock))
        try:
            yield
        finally:
            keeper.cancel()
            await self._release(lock, name)

    async def _release(self, lock: Lock, name: str) -> None:
        """Release now; when Redis refuses (down, or refusing writes on a full disk), keep trying in
        the background until it works or the lock's own timeout frees it, so the name is not held
        for the whole timeout after Redis recovers."""
        try:
            await lock.release()
            return
        except LockError:
            log.warning("registration lock of %r expired before release", name)
            return
        except Exception as e:
            log.warning("could not release the lock of %r (%s); retrying in the background", name, e)
        task = asyncio.create_task(self._release_later(lock, name))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_later(self, lock: Lock, name: str) -> None:
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            try:
                await lock.release()
                log.info("released the lock of %r after Redis recovered", name)
                return
            except LockError:
                return  # expired meanwhile: nothing held
            except Exception:  # noqa: BLE001 - still refused; the timeout is the last resort
                continue

    async def _keep(self, lock: Lock) -> None:
        while True:
            await asyncio.sleep(self.lock_timeout_s / 3)
            try:
                await lock.reacquire()
            except Exception as e:
                log.warning("could not extend lock %s: %s", lock.name, e)
