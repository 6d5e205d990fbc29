"""The index's event stream (`P events`, `P events_added`, index_schema.py): registered and
deleted events, read by WatchAdapters (watch_hub.py, servicer.py).

The events are written by the index's commit and delete scripts; this module reads them and tells
whether a watcher resuming from an id may have missed some (the stream trimmed, or lost).
A mixin of `AdapterIndex` (index.py), which owns the client and the prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import redis.asyncio as aioredis

EVENTS_MAXLEN = 10_000


def stream_position(event_id: str) -> tuple[int, int]:
    """A stream id ("1700000000000-3", or its milliseconds alone) as a comparable pair."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


class Event(NamedTuple):
    id: str
    type: str
    name: str
    digest: str
    generation: int
    time: float
    config_digest: str = ""
    files_digest: str = ""


class EventStream:
    """Reading the event stream (its writes are the index's scripts)."""

    r: aioredis.Redis
    p: str

    async def last_event_id(self) -> str:
        last = await self.r.xrevrange(f"{self.p}events", count=1)
        return last[0][0] if last else "0-0"

    async def events_missing_after(self, after: str) -> bool:
        """Whether the stream may no longer hold every event after `after`: older events are trimmed
        (it keeps about `events_max_len`), or the stream is not the one `after` came from (Redis lost
        it). A watcher resuming from `after` must then re-list instead of trusting the stream."""
        key = f"{self.p}events"
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.xrange(key, count=1)
            pipe.xrevrange(key, count=1)
            pipe.xlen(key)
            pipe.get(f"{self.p}events_added")
            first, last, length, added = await pipe.execute()
        position = stream_position(after)
        if not last:
            return position > (0, 0)  # events were seen that this (empty) stream never had
        if position > stream_position(last[0][0]):
            return True  # an id from past this stream's end: the stream was lost and begun again
        if added is not None and int(added) == length:
            return False  # nothing was ever trimmed
        # Trimmed (or a stream older than the count): the caller is covered only from its first entry.
        return position < stream_position(first[0][0])

    async def read_events(self, after: str, block_ms: int | None = 5000) -> list[Event]:
        """Up to 100 events after `after`; `block_ms` None returns at once."""
        got = await self.r.xread({f"{self.p}events": after}, count=100, block=block_ms)
        events = []
        for _stream, entries in got or []:
            for event_id, f in entries:
                events.append(
                    Event(
                        event_id,
                        f["type"],
                        f["name"],
                        f.get("digest", ""),
                        int(f["generation"]),
                        float(f["time"]),
                        f.get("config_digest", ""),
                        f.get("files_digest", ""),
                    )
                )
        return events
