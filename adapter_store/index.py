"""The Redis index: records, name -> digest, last-use order, per-name locks, the event stream.

Keys (all under the configured prefix P):
  P adapter:<name>   hash   the record's fields plus `generation` (its tokenizer files by
                           `files_digest` only: the files are on disk, tokenizer_store.py)
  P names            zset   every name at score 0, so ZRANGEBYLEX pages in name order
  P digests          hash   name -> digest
  P generations      hash   name -> generation (survives delete, so generations never repeat)
  P lru              zset   digest -> last use (unix seconds)
  P lock:<name>      string redis-py Lock held while one registration of <name> fetches
  P events           stream registered / deleted events (XADD MAXLEN ~, `--events-max-len`)
  P events_added     string how many events were ever added (with XLEN: whether any were trimmed;
                           a stream older than the count starts it past its length)
Writes that must agree (record + names + digests + generation + event) run in one Lua script,
and a commit names the generation it started from, so a registration whose lock expired
cannot overwrite a newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from loraplex.adapter_store.records import StoreRecord

log = logging.getLogger(__name__)
EVENTS_MAXLEN = 10_000

_COMMIT = """
local gen = tonumber(redis.call('HGET', KEYS[6], ARGV[2]) or '0')
if gen ~= tonumber(ARGV[1]) then return -1 end
gen = gen + 1
redis.call('HSET', KEYS[6], ARGV[2], gen)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'generation', gen, unpack(ARGV, 8))
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[3])
-- A stream from before events were counted may have been trimmed: count one more than it holds.
if redis.call('EXISTS', KEYS[7]) == 0 and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('SET', KEYS[7], redis.call('XLEN', KEYS[5]) + 1)
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'type', 'registered', 'name', ARGV[2],
           'digest', ARGV[3], 'config_digest', ARGV[6], 'files_digest', ARGV[7], 'generation', gen,
           'time', ARGV[4])
redis.call('INCR', KEYS[7])
return gen
"""

_DELETE = """
local digest = redis.call('HGET', KEYS[3], ARGV[1])
if not digest then return false end
local config_digest = redis.call('HGET', KEYS[1], 'config_digest') or ''
local files_digest = redis.call('HGET', KEYS[1], 'files_digest') or ''
local gen = redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
-- A stream from before events were counted may have been trimmed: count one more than it holds.
if redis.call('EXISTS', KEYS[7]) == 0 and redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('SET', KEYS[7], redis.call('XLEN', KEYS[5]) + 1)
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*', 'type', 'deleted', 'name', ARGV[1],
           'digest', digest, 'config_digest', config_digest, 'files_digest', files_digest,
           'generation', gen, 'time', ARGV[2])
redis.call('INCR', KEYS[7])
return {digest, gen, files_digest}
"""

# A record of the older format holds its tokenizer files inline (`files_json`): once they are in the
# tokenizer file store, drop them from Redis, unless the record changed meanwhile.
_UNINLINE = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'files_digest') ~= ARGV[2] then return 0 end
return redis.call('HDEL', KEYS[1], 'files_json')
"""

_RESTORE = """
local have = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
local gen = tonumber(ARGV[3])
if have >= gen and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[6], ARGV[1], math.max(have, gen))
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('HSET', KEYS[1], 'generation', math.max(have, gen))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
return 1
"""


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


# A record's fields but its tokenizer files: GetAdapter, ListAdapters and registration never need
# them, and a tokenizer.json is megabytes (a page of 1,000 records would read gigabytes).
LISTED_FIELDS = [f.name for f in dataclasses.fields(StoreRecord) if f.name != "files_json"]


def _fields(values: list) -> dict[str, str]:
    return {k: v for k, v in zip(LISTED_FIELDS, values, strict=True) if v is not None}


class AdapterIndex:
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
        self._commit = client.register_script(_COMMIT)
        self._delete = client.register_script(_DELETE)
        self._restore = client.register_script(_RESTORE)
        self._uninline = client.register_script(_UNINLINE)
        self._releasing: set[asyncio.Task] = set()  # lock releases retried after a refusal

    def _keys(self, name: str) -> list[str]:
        p = self.p
        return [
            f"{p}adapter:{name}",
            f"{p}names",
            f"{p}digests",
            f"{p}lru",
            f"{p}events",
            f"{p}generations",
            f"{p}events_added",
        ]

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
        return int(await self._commit(keys=self._keys(record.name), args=args))

    async def delete(self, name: str) -> tuple[str, int, str] | None:
        """Remove the name; return (digest it pointed at, new generation, its files_digest), or None
        if absent."""
        out = await self._delete(keys=self._keys(name), args=[name, time.time(), self.events_max_len])
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
        return bool(await self._restore(keys=self._keys(record.name), args=args))

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

    # -- locks -------------------------------------------------------------------------------
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

    # -- events ------------------------------------------------------------------------------
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
