"""Which adapters exist for this server: engine-resident, or pulled on demand from the store.

Resolution order for a name: loaded in the engine → adapter store (GetAdapter + one
PullAdapter, then engine load) → `AdapterNotFound`. Also counts requests in flight per
adapter, so a store delete (WatchAdapters) unloads an adapter only once they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.errors import AdapterNotFound, InvalidRequest, LoraplexError
from loraplex.services.inference.local_sources import check_allowed, local_path, looks_local
from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.lora.names import is_served_model_name
from loraplex.services.inference.metrics import Metrics
from loraplex.services.inference.proto_convert import check_adapter_name, check_source
from loraplex.services.inference.store_client import PulledAdapter, StoreClient
from loraplex.services.inference.store_pull import content_dir_name

log = logging.getLogger(__name__)
LIST_PAGE_MAX = 1000  # adapters per ListAdapters page (the store's page limit too)


@dataclass(eq=False)
class _NameLock:
    lock: asyncio.Lock
    users: int = 0  # holder and waiters


def _content(record) -> tuple[str, str, str]:
    return record.digest, record.config_digest, record.files_digest


class AdapterResolver:
    def __init__(
        self, engine: Engine, store: StoreClient | None, metrics: Metrics, allowed_dirs: tuple[str, ...] = ()
    ):
        self.engine = engine
        self.store = store
        self.metrics = metrics
        self.allowed_dirs = allowed_dirs
        self.in_flight: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._deleting: dict[str, asyncio.Task] = {}
        # name -> (source, weights digest, config digest, tokenizer files digest) as the user and the
        # store know them, not the local cache path; the three digests together are the adapter's content
        self._origin: dict[str, tuple[str, str, str, str]] = {}
        # A name whose version is being replaced: calls naming it wait until the swap is done, and
        # the swap waits for the calls already running, so one call sees one version per name.
        self._swapping: dict[str, asyncio.Event] = {}
        # LoadAdapter calls for one name run one at a time: each response reports what it loaded.
        self._load_locks: dict[str, _NameLock] = {}

    # -- requests in flight ---------------------------------------------------------------
    def acquire(self, name: str) -> None:
        self.in_flight[name] += 1
        self._idle.setdefault(name, asyncio.Event()).clear()
        self.metrics.adapter_requests.labels(self.metrics.label(name)).inc()

    def release(self, name: str) -> None:
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]
            # Waiters hold the event itself; the table keeps only names with requests in flight.
            idle = self._idle.pop(name, None)
            if idle is not None:
                idle.set()

    def per_name_tables(self) -> dict[str, int]:
        """Sizes of the per-name tables (bounded by the adapters loaded, busy or changing here)."""
        tables = ("in_flight", "_idle", "_loading", "_deleting", "_origin", "_swapping", "_load_locks")
        return {t: len(getattr(self, t)) for t in tables}

    def per_name_state(self) -> int:
        return sum(self.per_name_tables().values())

    async def wait_idle(self, name: str) -> None:
        if self.in_flight.get(name, 0) > 0:
            await self._idle.setdefault(name, asyncio.Event()).wait()

    # -- resolution -----------------------------------------------------------------------
    async def ensure(self, names: set[str]) -> None:
        """Make every named adapter available, or raise for the first that cannot be. Returns with
        no swap of any of them under way: the caller must `acquire` them before its next await."""
        names = {n for n in names if n}
        while True:
            results = await asyncio.gather(
                *(self._ensure_one(n) for n in sorted(names)), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            swaps = [self._swapping[n] for n in names if n in self._swapping]
            if not swaps:
                return
            for swap in swaps:
                await swap.wait()

    @contextlib.asynccontextmanager
    async def _swap(self, name: str) -> AsyncIterator[None]:
        """Exclusive use of `name` while its version changes: new calls wait, running ones finish first."""
        while (other := self._swapping.get(name)) is not None:
            await other.wait()
        done = asyncio.Event()
        self._swapping[name] = done
        try:
            await self.wait_idle(name)
            yield
        finally:
            del self._swapping[name]
            done.set()

    @contextlib.asynccontextmanager
    async def _load_lock(self, name: str) -> AsyncIterator[None]:
        # The entry counts its holder and waiters, and goes only when the last leaves. `lock.locked()`
        # cannot tell: between a release and the woken waiter's acquire it is False, and a lock
        # dropped then let the next caller make a fresh one and run beside that waiter.
        entry = self._load_locks.setdefault(name, _NameLock(asyncio.Lock()))
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._load_locks[name]

    async def _ensure_one(self, name: str) -> None:
        while (swap := self._swapping.get(name)) is not None:
            await swap.wait()
        if name in self._deleting:
            await asyncio.shield(self._deleting[name])
        if self.engine.has_adapter(name):
            return
        # Not pulled: a store without --base-model cannot refuse it, and pulled it would shadow the model.
        self._check_not_model(name, "adapter")
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
        async with self.store.held(name) as pulled:  # not evicted before the engine has read it
            return await self._load_pulled(pulled, pin)

    async def _load_pulled(self, pulled: PulledAdapter, pin: bool) -> AdapterInfo:
        record = pulled.record
        info = await self._engine_load(pulled.name, pulled.path, pin)
        self._origin[pulled.name] = (record.source, record.digest, record.config_digest, record.files_digest)
        return self._with_origin(info)

    def _with_origin(self, info: AdapterInfo) -> AdapterInfo:
        if info.name in self._origin:
            info.source, info.digest = self._origin[info.name][0], self._origin[info.name][1] or info.digest
        return info

    async def _engine_load(self, name: str, path: Path, pin: bool) -> AdapterInfo:
        try:
            info = await self.engine.load_adapter(name, str(path), pin)
        except LoraplexError as exc:
            # Name the adapter in the message and in the ResourceInfo detail.
            exc.adapter = exc.adapter or name
            if repr(name) not in exc.message:
                exc.message = f"adapter {name!r}: {exc.message}"
            raise
        self.metrics.adapter_loads.labels(self.metrics.label(name)).inc()
        log.info("adapter %s loaded from %s (pin=%s)", name, path, pin)
        return info

    def _check_not_model(self, name: str, field: str) -> None:
        model = self.engine.model_info().model
        if is_served_model_name(name, model):
            raise InvalidRequest(
                f"adapter name {name!r} is the name of this server's model ({model[:200]}), which the "
                "HTTP door and /v1/models use for the base model; "
                + (
                    "give the adapter another name"
                    if field == "name"
                    else "send no adapter for the base model"
                ),
                field=field,
            )

    def cache_dirs_in_use(self) -> set[str]:
        """Names of the cache directories loaded adapters were read from: the engine may read them
        again (after dropping a host copy), so the cache never evicts them."""
        return {Path(info.source).name for info in self.engine.list_adapters() if info.source}

    # -- explicit management ----------------------------------------------------------------
    async def load(self, name: str, source: str, revision: str, pin: bool) -> AdapterInfo:
        check_adapter_name(name)
        self._check_not_model(name, "name")
        check_source(source, revision)
        async with self._load_lock(name):
            if self.store is None:
                path = local_path(source, self.allowed_dirs)
                async with self._swap(name):
                    await self._unload_if_loaded(name)
                    info = await self._engine_load(name, path, pin)
                    self._origin[name] = (source, "", "", "")
                    return self._with_origin(info)
            if looks_local(source) and self.allowed_dirs:
                # The store reads it; honour the allow-list by sending the very path that was checked.
                source = str(check_allowed(source, self.allowed_dirs))
            record = await self.store.register(name, source, revision)
            async with contextlib.AsyncExitStack() as held:  # not evicted before the engine has read it
                pulled = await held.enter_async_context(self.store.held(name))
                if _content(pulled.record) != _content(record):
                    # joined a pull of the content it replaced
                    pulled = await held.enter_async_context(self.store.held(name))
                async with self._swap(name):
                    await self._unload_if_loaded(name)
                    try:
                        return await self._load_pulled(pulled, pin)
                    except LoraplexError as exc:
                        # Kept on purpose: the store is shared, and other servers' limits may admit it.
                        exc.message += (
                            f" (the adapter store keeps {name!r} registered for servers that can serve "
                            "it; DeleteAdapter there removes it)"
                        )
                        raise

    async def _unload_if_loaded(self, name: str) -> None:
        if self.engine.has_adapter(name):
            await self.engine.unload_adapter(name)

    async def unload(self, name: str) -> None:
        """Without a store: unload here. With one: delete it there, which unloads it on every
        replica that shares the store (each drops it through WatchAdapters once its requests
        finish) - unloading on this replica alone would only last until the next request
        pulled it back, and behind a router that replica is whichever one the call reached."""
        check_adapter_name(name)
        here = self.engine.has_adapter(name)
        if self.store is not None:
            deleted = await self.store.delete(name)
            if not deleted and not here:
                raise AdapterNotFound(
                    f"adapter {name!r} is neither in the adapter store nor loaded here", adapter=name
                )
            self._origin.pop(name, None)
        elif not here:
            raise AdapterNotFound(f"adapter {name!r} is not loaded on this server", adapter=name)
        if here:
            try:
                await self.engine.unload_adapter(name)
            except AdapterNotFound:
                if self.store is None:
                    raise  # with a store, the delete's watch event may have unloaded it first

    async def on_store_event(
        self, kind: str, name: str, digest: str, config_digest: str = "", files_digest: str = ""
    ) -> None:
        """A store delete, or a re-register with new content (weights, config or tokenizer files),
        drops the adapter here once its running requests finish; the next request then pulls what
        the store has now."""
        content = (digest, config_digest, files_digest)
        if kind == "registered":
            known = self._origin.get(name)
            # An event without a config digest (an older store) cannot prove the content unchanged.
            if known is None or not known[1] or (config_digest and known[1:] == content):
                return
        elif kind != "deleted":
            return
        if name in self._deleting:
            return
        task = asyncio.create_task(self._drop_when_idle(name, content if kind == "registered" else None))
        self._deleting[name] = task
        task.add_done_callback(lambda _t: self._deleting.pop(name, None))

    async def _drop_when_idle(self, name: str, new_content: tuple[str, str, str] | None) -> None:
        async with self._swap(name):
            if (
                new_content is not None
                and new_content[1]
                and self._origin.get(name, ("", "", "", ""))[1:] == new_content
            ):
                return  # meanwhile this server loaded the new content itself
            try:
                if self.engine.has_adapter(name):
                    await self.engine.unload_adapter(name)
                    log.info("adapter %s deleted or replaced in the store; unloaded here", name)
            except LoraplexError as exc:
                log.warning("could not unload deleted adapter %s: %s", name, exc)
                return
            origin = self._origin.pop(name, None)
            if origin is not None and origin[1] and origin[2] and self.store is not None:
                # Its files go too, unless another loaded adapter reads the same content.
                in_use = self.cache_dirs_in_use()
                await asyncio.to_thread(self.store.cache.discard, content_dir_name(*origin[1:]), in_use)

    async def list(self, page_size: int = 0, after: str = "") -> tuple[list[AdapterInfo], str]:
        """One page, in name order, of the adapters loaded here and those only in the store, and the
        next page's token ("" at the end). Pages are built from one store page at a time, never
        from a listing of the whole store."""
        page_size = min(page_size or LIST_PAGE_MAX, LIST_PAGE_MAX)
        if after:
            check_adapter_name(after)
        adapters = sorted((a for a in self.engine.list_adapters() if a.name > after), key=lambda a: a.name)
        for info in adapters:
            self._with_origin(info)
            info.requests_in_flight = max(info.requests_in_flight, self.in_flight.get(info.name, 0))
        store_more = False
        if self.store is not None:
            here = {a.name for a in adapters}
            try:
                records, token = await self.store.list_page(page_size, after)
                store_more = bool(token)
            except LoraplexError as exc:
                log.warning("ListAdapters: store unavailable, listing local adapters only: %s", exc)
                records = []
            for rec in records:
                if rec.name not in here:
                    adapters.append(
                        AdapterInfo(
                            name=rec.name,
                            rank=rec.rank,
                            alpha=rec.alpha,
                            target_modules=list(rec.target_modules),
                            location="store",
                            source=rec.source,
                            digest=rec.digest,
                        )
                    )
            if store_more and records:
                # Store names past this page are unknown yet: local ones past it wait for a later page.
                adapters = [a for a in adapters if a.name <= records[-1].name]
            adapters.sort(key=lambda a: a.name)
        page = adapters[:page_size]
        more = store_more or len(adapters) > page_size
        return page, (page[-1].name if more and page else "")
