"""The store's Redis client under a burst of more concurrent calls than its pool has connections: the
calls queue for a free connection and all succeed. (With redis-py's default pool the calls beyond
`max_connections` failed at once as "Too many connections", which the store answers UNAVAILABLE:
300 WatchAdapters streams subscribing together on a loaded machine hit it.)"""

from __future__ import annotations

import asyncio

from loraplex.adapter_store import redis_embedded
from loraplex.adapter_store.redis_embedded import EmbeddedRedis


def test_a_burst_beyond_the_pool_queues_instead_of_failing(tmp_path, monkeypatch):
    monkeypatch.setitem(redis_embedded._CLIENT_OPTIONS, "max_connections", 4)
    server = EmbeddedRedis(tmp_path / "redis")

    async def burst() -> list:
        client = server.client()
        try:
            await client.xadd("events", {"n": "1"})
            calls = [client.xrevrange("events", count=1) for _ in range(64)]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await client.aclose()

    try:
        results = asyncio.run(burst())
    finally:
        server.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(len(r) == 1 and r[0][1] == {"n": "1"} for r in results)
