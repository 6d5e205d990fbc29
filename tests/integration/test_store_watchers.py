"""Many idle WatchAdapters streams share one Redis reader: the store keeps answering other calls
(its Redis pool has 256 connections, fewer than the watchers), every watcher gets each
event, and watchers beyond --max-watchers get RESOURCE_EXHAUSTED with a message that says why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.support.store_helpers import start_store

WATCHERS = 300


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-watchers", r=4)


async def _refused(stub) -> grpc.aio.AioRpcError | None:
    """One more watcher: its error when refused at once, None (and cancelled) when admitted."""
    call = stub.WatchAdapters(pb.WatchAdaptersRequest())
    try:
        await asyncio.wait_for(call.read(), 1.5)
    except grpc.aio.AioRpcError as e:
        return e
    except TimeoutError:
        call.cancel()
    return None


async def _scenario(address: str, good: Path) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        calls = [stub.WatchAdapters(pb.WatchAdaptersRequest()) for _ in range(WATCHERS)]
        await asyncio.wait_for(asyncio.gather(*(c.initial_metadata() for c in calls)), 60)  # all subscribed
        loop = asyncio.get_running_loop()
        refusal = await _refused(stub)
        assert refusal is not None and refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-watchers" in refusal.details()
        # Every other call still works with 300 watchers open...
        record = await stub.RegisterAdapter(
            pb.RegisterAdapterRequest(name="watched", source=str(good)), timeout=30
        )
        assert (
            await stub.GetAdapter(pb.GetAdapterRequest(name="watched"), timeout=10)
        ).digest == record.digest
        # ...and every watcher sees the event.
        events = await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls)), 30)
        assert {(e.type, e.name, e.digest, e.config_digest) for e in events} == {
            ("registered", "watched", record.digest, record.config_digest)
        }
        for call in calls:
            call.cancel()
        deadline = loop.time() + 30
        while await _refused(stub) is not None:  # closed watchers free their places
            assert loop.time() < deadline, "closed watchers still count against --max-watchers"


def test_many_idle_watchers_share_one_reader(tmp_path, good):
    with start_store(tmp_path / "cache", "--max-watchers", str(WATCHERS)) as proc:
        asyncio.run(_scenario(proc.address, good))
        assert "Too many connections" not in proc.output()
