"""Which adapters exist for this server: engine-resident, or pulled on demand from the store.

Resolution order for a name: loaded in the engine → adapter store (GetAdapter + one
PullAdapter, then engine load) → `AdapterNotFound`. Also counts requests in flight per
adapter, so a store delete (WatchAdapters) unloads an adapter only once they finish.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from services.inference.engine.types import AdapterInfo
from services.inference.errors import AdapterNotFound, InvalidRequest, LoraplexError
from services.inference.metrics import Metrics
from services.inference.proto_convert import check_adapter_name, check_source
from services.inference.store_client import StoreClient

log = logging.getLogger(__name__)


async def call(fn, *args: Any, **kwargs: Any) -> Any:
    """Call an engine method that may be sync or async; sync ones run off the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def looks_local(source: str) -> bool:
    """A filesystem path or file:// URI rather than a Hub reference (`org/repo`, `hf://...`)."""
    if source.startswith("file://"):
        return True
    if "://" in source:
        return False
    if source.startswith(("/", ".", "~")):
        return True
    try:
        return Path(source).expanduser().exists()
    except OSError:  # too long to be a path here
        return False


def check_allowed(source: str, allowed_dirs: tuple[str, ...]) -> Path:
    """The resolved path of a local source; InvalidRequest if it escapes --allowed-local-dirs
    (symlinks and '..' are resolved first, so neither can lead out)."""
    path = Path(source.removeprefix("file://")).expanduser().resolve()
    if allowed_dirs and not any(path.is_relative_to(Path(d).expanduser().resolve()) for d in allowed_dirs):
        raise InvalidRequest(f"source {source!r} is outside --allowed-local-dirs", field="source")
    return path


def local_path(source: str, allowed_dirs: tuple[str, ...]) -> Path:
    """A local source (path or file:// URI) as a directory, checked against --allowed-local-dirs."""
    if source.startswith("hf://"):
        raise InvalidRequest(
            f"source {source!r} is a Hub reference; this server has no adapter store (--adapter-store none) "
            "to fetch it, so give a local directory",
            field="source",
        )
    path = check_allowed(source, allowed_dirs)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # e.g. a name longer than the filesystem allows
        raise InvalidRequest(f"source {source[:200]!r} is not a usable path: {exc.strerror}", field="source") from None
    if not is_dir:
        raise AdapterNotFound(f"adapter source {source!r} is not a directory on the server", field="source")
    return path


class AdapterResolver:
    def __init__(self, engine, store: StoreClient | None, metrics: Metrics, allowed_dirs: tuple[str, ...] = ()):
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.allowed_dirs = allowed_dirs
        self.in_flight: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._deleting: dict[str, asyncio.Task] = {}
        # name -> (source, digest) as the user and the store know them, not the local cache path
        self._origin: dict[str, tuple[str, str]] = {}

    # -- requests in flight ---------------------------------------------------------------
    def acquire(self, name: str) -> None:
        self.in_flight[name] += 1
        self._idle.setdefault(name, asyncio.Event()).clear()
        self.metrics.adapter_requests.labels(name).inc()

    def release(self, name: str) -> None:
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]
            self._idle.setdefault(name, asyncio.Event()).set()

    async def wait_idle(self, name: str) -> None:
        if self.in_flight.get(name, 0) > 0:
            await self._idle.setdefault(name, asyncio.Event()).wait()

    # -- resolution -----------------------------------------------------------------------
    async def ensure(self, names: set[str]) -> None:
        """Make every named adapter available, or raise for the first that cannot be."""
        names = {n for n in names if n}
        results = await asyncio.gather(*(self._ensure_one(n) for n in sorted(names)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _ensure_one(self, name: str) -> None:
        if name in self._deleting:
            await asyncio.shield(self._deleting[name])
        if await call(self.engine.has_adapter, name):
            return
        if self.store is None:
            raise AdapterNotFound(
                f"adapter {name!r} is not loaded on this server (no adapter store configured; "
                "load it with LoadAdapter or --lora-paths)",
                adapter=name,
            )
        task = self._loading.get(name)
        if task is None:
            task = asyncio.create_task(self._pull_and_load(name, pin=False))
            self._loading[name] = task
            task.add_done_callback(lambda _t, n=name: self._loading.pop(n, None))
        await asyncio.shield(task)

    async def _pull_and_load(self, name: str, *, pin: bool) -> AdapterInfo:
        assert self.store is not None
        pulled = await self.store.fetch(name)
        self._origin[name] = (pulled.record.source, pulled.record.digest)
        return self._with_origin(await self._engine_load(name, pulled.path, pin))

    def _with_origin(self, info: AdapterInfo) -> AdapterInfo:
        if info.name in self._origin:
            info.source, info.digest = self._origin[info.name][0], self._origin[info.name][1] or info.digest
        return info

    async def _engine_load(self, name: str, path: Path, pin: bool) -> AdapterInfo:
        try:
            info = await call(self.engine.load_adapter, name, str(path), pin)
        except LoraplexError as exc:
            # Name the adapter in the message and in the ResourceInfo detail.
            exc.adapter = exc.adapter or name
            if repr(name) not in exc.message:
                exc.message = f"adapter {name!r}: {exc.message}"
            raise
        self.metrics.adapter_loads.labels(name).inc()
        log.info("adapter %s loaded from %s (pin=%s)", name, path, pin)
        return info

    # -- explicit management ----------------------------------------------------------------
    async def load(self, name: str, source: str, revision: str, pin: bool) -> AdapterInfo:
        check_adapter_name(name)
        check_source(source, revision)
        if await call(self.engine.has_adapter, name):
            await self.wait_idle(name)
            await call(self.engine.unload_adapter, name)
        if self.store is None:
            self._origin[name] = (source, "")
            return self._with_origin(await self._engine_load(name, local_path(source, self.allowed_dirs), pin))
        if looks_local(source):
            check_allowed(source, self.allowed_dirs)  # the store reads it; still honour the allow-list
        await self.store.register(name, source, revision)
        return await self._pull_and_load(name, pin=pin)

    async def unload(self, name: str) -> None:
        """Without a store: unload here. With one: delete it there, which unloads it on every
        replica that shares the store (each drops it through WatchAdapters once its requests
        finish) - unloading on this replica alone would only last until the next request
        pulled it back, and behind a router that replica is whichever one the call reached."""
        check_adapter_name(name)
        here = await call(self.engine.has_adapter, name)
        if self.store is not None:
            deleted = await self.store.delete(name)
            if not deleted and not here:
                raise AdapterNotFound(f"adapter {name!r} is neither in the adapter store nor loaded here",
                                      adapter=name)
            self._origin.pop(name, None)
        elif not here:
            raise AdapterNotFound(f"adapter {name!r} is not loaded on this server", adapter=name)
        if here:
            try:
                await call(self.engine.unload_adapter, name)
            except AdapterNotFound:
                if self.store is None:
                    raise  # with a store, the delete's watch event may have unloaded it first

    async def on_store_event(self, kind: str, name: str, digest: str) -> None:
        """A store delete, or a re-register with new content, drops the adapter here once its
        running requests finish; the next request then pulls what the store has now."""
        if kind == "registered":
            known = self._origin.get(name)
            if known is None or not known[1] or known[1] == digest:
                return
        elif kind != "deleted":
            return
        if name in self._deleting:
            return
        task = asyncio.create_task(self._drop_when_idle(name, digest if kind == "registered" else None))
        self._deleting[name] = task
        task.add_done_callback(lambda _t: self._deleting.pop(name, None))

    async def _drop_when_idle(self, name: str, new_digest: str | None) -> None:
        await self.wait_idle(name)
        if new_digest is not None and self._origin.get(name, ("", ""))[1] == new_digest:
            return  # meanwhile this server loaded the new content itself
        try:
            if await call(self.engine.has_adapter, name):
                await call(self.engine.unload_adapter, name)
                self._origin.pop(name, None)
                log.info("adapter %s deleted or replaced in the store; unloaded here", name)
        except LoraplexError as exc:
            log.warning("could not unload deleted adapter %s: %s", name, exc)

    async def list(self) -> list[AdapterInfo]:
        adapters = list(await call(self.engine.list_adapters))
        for info in adapters:
            self._with_origin(info)
            info.requests_in_flight = max(info.requests_in_flight, self.in_flight.get(info.name, 0))
        if self.store is not None:
            here = {a.name for a in adapters}
            try:
                records = await self.store.list()
            except LoraplexError as exc:
                log.warning("ListAdapters: store unavailable, listing local adapters only: %s", exc)
                records = []
            for rec in records:
                if rec.name not in here:
                    adapters.append(
                        AdapterInfo(
                            name=rec.name, rank=rec.rank, alpha=rec.alpha, target_modules=list(rec.target_modules),
                            location="store", source=rec.source, digest=rec.digest,
                        )
                    )
        return adapters
