"""The Redis index: records, name -> digest, last-use order (the key layout and the scripts that
write several keys as one: index_schema.py). Its per-name locks are index_locks.py's, its event
stream index_events.py's (both mixins of AdapterIndex, which owns the client and the prefix).

Writes that must agree (record + names + digests + generation + event) run in one Lua script,
and a commit names the generation it started from, so a registration whose lock expired
cannot overwrite a newer one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import redis.asyncio as aioredis

from loraplex.adapter_store.index_events import EVENTS_MAXLEN, EventStream
from loraplex.adapter_store.index_locks import NameLocks
from loraplex.adapter_store.index_schema import (
    COMMIT_SCRIPT,
    DELETE_SCRIPT,
    RESTORE_SCRIPT,
    UNINLINE_SCRIPT,
    record_keys,
)
from loraplex.adapter_store.records import StoreRecord

# A record's fields but its tokenizer files: GetAdapter, ListAdapters and registration never need
# them, and a tokenizer.json is megabytes (a page of 1,000 records would read gigabytes).
LISTED_FIELDS = [f.name for f in dataclasses.fields(StoreRecord) if f.name != "files_json"]


def _fields(values: list) -> dict[str, str]:
    return {k: v for k, v in zip(LISTED_FIELDS, values, strict=True) if v is not None}


class AdapterIndex(NameLocks, EventStream):
    """The store's records in Redis, with the name locks and the event stream of its two mixins."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "loraplex:",
        lock_timeout_s: float = 30.0,
        events_max_len: int = EVENTS_MAXLEN,
    ):
        self.r = client
        self.p = prefix
        self.lock_timeout_s = lock_timeout_s
        self.events_max_len = events_max_len
        self._commit = client.register_script(COMMIT_SCRIPT)
        self._delete = client.register_script(DELETE_SCRIPT)
        self._restore = client.register_script(RESTORE_SCRIPT)
        self._uninline = client.register_script(UNINLINE_SCRIPT)
        self._releasing: set[asyncio.Task] = set()  # lock releases retried after a refusal (index_locks.py)

    async def ping(self) -> None:
        await self.r.ping()

    async def get(self, name: str, with_files: bool = False) -> StoreRecord | None:
        """The record; `files_json` only `with_files` (a pull): a record of the older format holds
        its tokenizer files there (megabytes), a current one only their `files_digest`."""
        key = f"{self.p}adapter:{name}"
        if with_files:
            data = await self.r.hgetall(key)
        else:
            data = _fields(await self.r.hmget(key, LISTED_FIELDS))
        return StoreRecord.from_redis(data) if data else None

    async def generation(self, name: str) -> int:
        return int(await self.r.hget(f"{self.p}generations", name) or 0)

    async def commit(self, record: StoreRecord, expected_generation: int) -> int:
        """Write `record` if the name is still at `expected_generation`; return the new one, or -1."""
        fields = record.to_redis()
        fields.pop("generation")
        flat = [x for kv in fields.items() for x in kv]
        args = [
            expected_generation,
            record.name,
            record.digest,
            record.last_used_at,
            self.events_max_len,
            record.config_digest,
            record.files_digest,
            *flat,
        ]
        return int(await self._commit(keys=record_keys(self.p, record.name), args=args))

    async def delete(self, name: str) -> tuple[str, int, str] | None:
        """Remove the name; return (digest it pointed at, new generation, its files_digest), or None
        if absent."""
        args = [name, time.time(), self.events_max_len]
        out = await self._delete(keys=record_keys(self.p, name), args=args)
        return (out[0], int(out[1]), out[2]) if out else None

    async def names_with_inline_files(self) -> list[str]:
        """Names whose record still holds its tokenizer files inline (the older format)."""
        names = await self.r.zrange(f"{self.p}names", 0, -1)
        found = []
        for start in range(0, len(names), 500):
            page = names[start : start + 500]
            async with self.r.pipeline(transaction=False) as pipe:
                for n in page:
                    pipe.hstrlen(f"{self.p}adapter:{n}", "files_json")
                found += [n for n, length in zip(page, await pipe.execute(), strict=True) if length]
        return found

    async def files_digests(self, names: list[str]) -> dict[str, str | None]:
        """Each name's record's files_digest ("" for none), None where the name has no record."""
        async with self.r.pipeline(transaction=False) as pipe:
            for n in names:
                pipe.hmget(f"{self.p}adapter:{n}", ["name", "files_digest"])
            rows = await pipe.execute()
        return {n: (None if row[0] is None else row[1] or "") for n, row in zip(names, rows, strict=True)}

    async def drop_inline_files(self, name: str, generation: int, files_digest: str) -> bool:
        """Remove the record's inline `files_json` if it is still at `generation` with `files_digest`."""
        keys = [f"{self.p}adapter:{name}"]
        return bool(await self._uninline(keys=keys, args=[generation, files_digest]))

    async def restore(self, record: StoreRecord) -> bool:
        """Put back a record from a sidecar unless the index already has it at that generation or newer."""
        fields = record.to_redis()
        fields.pop("generation")
        flat = [x for kv in fields.items() for x in kv]
        args = [record.name, record.digest, record.generation, record.last_used_at, *flat]
        return bool(await self._restore(keys=record_keys(self.p, record.name), args=args))

    async def touch(self, name: str, digest: str) -> float:
        now = time.time()
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(f"{self.p}adapter:{name}", "last_used_at", now)
            pipe.zadd(f"{self.p}lru", {digest: now})
            await pipe.execute()
        return now

    async def list_page(self, page_size: int, after: str) -> tuple[list[StoreRecord], str]:
        start = f"({after}" if after else "-"
        names = await self.r.zrangebylex(f"{self.p}names", start, "+", start=0, num=page_size + 1)
        more = len(names) > page_size
        names = names[:page_size]
        async with self.r.pipeline(transaction=False) as pipe:
            for n in names:
                pipe.hmget(f"{self.p}adapter:{n}", LISTED_FIELDS)
            rows = [_fields(values) for values in await pipe.execute()]
        records = [StoreRecord.from_redis(d) for d in rows if d]
        return records, (names[-1] if more and names else "")

    async def names_by_digest(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, digest in (await self.r.hgetall(f"{self.p}digests")).items():
            out.setdefault(digest, []).append(name)
        return out

    async def lru_digests(self) -> list[str]:
        """Digests, least recently used first."""
        return await self.r.zrange(f"{self.p}lru", 0, -1)

    async def forget_digest(self, digest: str) -> None:
        await self.r.zrem(f"{self.p}lru", digest)

    async def count(self) -> int:
        return int(await self.r.zcard(f"{self.p}names"))
