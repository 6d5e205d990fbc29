"""One Redis reader of the event stream, fanned out to every WatchAdapters stream.

A watcher blocking in its own XREAD would hold a pooled Redis connection for as long as it
stayed open, so a few hundred idle watchers would take every connection and fail every other
store call. Instead one task reads the stream while anyone watches and hands each event to every
subscriber's queue; a subscriber catches up on its backlog with short non-blocking reads.
The number of subscribers is bounded (`--max-watchers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from loraplex.adapter_store.errors import ResourceExhausted, StoreError, Unavailable
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.index_events import Event

log = logging.getLogger(__name__)
# A subscriber this far behind is ended (UNAVAILABLE) rather than buffering without bound; it
# reconnects with its last event id and catches up from the stream.
MAX_BACKLOG = 10_000


class Subscription:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event | StoreError] = asyncio.Queue()
        self.ended = False

    def offer(self, item: Event | StoreError) -> None:
        if self.ended:
            return
        if isinstance(item, StoreError) or self.queue.qsize() >= MAX_BACKLOG:
            self.ended = True
            if not isinstance(item, StoreError):
                item = Unavailable(f"this watcher fell {MAX_BACKLOG} events behind")
        self.queue.put_nowait(item)

    async def next(self) -> Event:
        item = await self.queue.get()
        if isinstance(item, StoreError):
            raise item
        return item


class WatchHub:
    def __init__(self, index: AdapterIndex, max_watchers: int, block_ms: int) -> None:
        self.index = index
        self.max_watchers = max_watchers
        self.block_ms = block_ms
        self._subs: set[Subscription] = set()
        self._reader: asyncio.Task | None = None
        self._start_lock = asyncio.Lock()
        self._stopping = False

    @property
    def watchers(self) -> int:
        return len(self._subs)

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        """A live feed of events newer than the reader's position at the time of the call."""
        if self._stopping:
            raise Unavailable("the adapter store is shutting down; reconnect to another or later")
        if len(self._subs) >= self.max_watchers:
            raise ResourceExhausted(
                f"{len(self._subs)} WatchAdapters streams are open, the most this store serves "
                f"(--max-watchers {self.max_watchers}); close idle watchers or raise the limit"
            )
        sub = Subscription()
        self._subs.add(sub)
        try:
            await self._ensure_reader()
            yield sub
        finally:
            self._subs.discard(sub)
            if not self._subs and self._reader is not None:
                self._reader.cancel()
                self._reader = None

    async def _ensure_reader(self) -> None:
        async with self._start_lock:
            if self._reader is not None and not self._reader.done():
                return
            # Read before returning: the subscriber's catch-up then reaches at least this position.
            start = await self.index.last_event_id()
            self._reader = asyncio.create_task(self._read(start))

    async def _read(self, position: str) -> None:
        try:
            while self._subs and not self._stopping:
                for event in await self.index.read_events(position, block_ms=self.block_ms):
                    position = event.id
                    for sub in list(self._subs):
                        sub.offer(event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Redis trouble ends every watcher; they reconnect
            log.warning("the event reader stopped: %s", e)
            self._fail_all(Unavailable(f"the store's Redis index failed while watching ({e})"))
        finally:
            if self._reader is asyncio.current_task():
                self._reader = None

    def _fail_all(self, error: StoreError) -> None:
        for sub in list(self._subs):
            sub.offer(error)

    def stop(self) -> None:
        """Every watcher ends with UNAVAILABLE (clients reconnect elsewhere) instead of holding the drain."""
        self._stopping = True
        self._fail_all(Unavailable("the adapter store is shutting down"))
        if self._reader is not None:
            self._reader.cancel()
