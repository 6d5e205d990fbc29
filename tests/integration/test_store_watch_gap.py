"""Issue 59: a watcher resuming from an id its store's event stream no longer covers. The store keeps
the latest `--events-max-len` events (about: whole stream nodes go); a replica cut off for longer
used to resume from its last id and silently skip the trimmed events (a delete among them left a
deleted adapter served). The store now answers such a resume with a `resync` event, and the
inference side's watcher re-lists the store and hands on what changed.

A real Redis (nodes of 2 entries, so a short stream trims at once), the store subprocess on it, real
gRPC, and the inference side's StoreClient behind a proxy that cuts it off."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from loraplex.services.inference import store_watch
from loraplex.services.inference.store_client import StoreClient
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.support.reliability_proxy import CuttingProxy
from tests.support.store_helpers import RedisServer, start_store, store_stub, write_random_adapter

pytestmark = pytest.mark.timeout(120)
MAX_LEN = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("watch-gap")
    source = write_random_adapter(root / "src", hidden=64, layers=2, r=4)
    server = RedisServer()
    server.start()
    # Trimming removes whole nodes only: with 2 entries a node, the stream keeps about MAX_LEN events.
    redis.Redis(unix_socket_path=str(server.socket)).config_set("stream-node-max-entries", 2)
    try:
        flags = ("--redis-url", server.url, "--events-max-len", str(MAX_LEN))
        with start_store(root / "store", *flags) as proc:
            yield proc.address, str(source), server
    finally:
        server.close()


def churn(stub, source: str, events: int) -> None:
    """`events` events (register / delete of one name, in turns)."""
    for i in range(events):
        if i % 2 == 0:
            stub.RegisterAdapter(pb.RegisterAdapterRequest(name="churn", source=source), timeout=30)
        else:
            stub.DeleteAdapter(pb.DeleteAdapterRequest(name="churn"), timeout=30)


def first_events(stub, last_event_id: str, n: int) -> list[pb.AdapterEvent]:
    call = stub.WatchAdapters(pb.WatchAdaptersRequest(last_event_id=last_event_id), timeout=30)
    got = []
    for event in call:
        got.append(event)
        if len(got) == n:
            break
    call.cancel()
    return got


def test_a_resume_from_a_trimmed_id_is_told_to_resync(store):
    address, source, _ = store
    with store_stub(address) as stub:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="early", source=source), timeout=30)
        (seen,) = first_events(stub, "0", 1)  # the oldest event still held
        churn(stub, source, 12)  # far past MAX_LEN: everything up to here is trimmed
        recent = first_events(stub, "0", 1)[0].id
        assert recent > seen.id
        # Resuming from the trimmed id: a resync marker first, then what follows it.
        (marker,) = first_events(stub, seen.id, 1)
        assert marker.type == "resync" and marker.time > 0 and marker.name == ""
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="later", source=source), timeout=30)
        after = first_events(stub, marker.id, 1)
        assert [(e.type, e.name) for e in after] == [("registered", "later")]
        # Resuming from an id the stream still holds: its events, no marker.
        stub.DeleteAdapter(pb.DeleteAdapterRequest(name="later"), timeout=30)
        resumed = first_events(stub, after[0].id, 1)
        assert [(e.type, e.name) for e in resumed] == [("deleted", "later")]


async def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_watcher_cut_off_past_the_trim_re_lists_and_sees_the_delete(store, tmp_path):
    address, source, _ = store
    proxy = CuttingProxy(address)
    events: list[tuple[str, str]] = []

    async def on_event(kind: str, name: str, digest: str, config_digest: str, files_digest: str) -> None:
        events.append((kind, name))

    async def scenario() -> None:
        client = StoreClient(proxy.address, tmp_path / "cache")
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.AdapterStoreStub(channel)
            await stub.RegisterAdapter(pb.RegisterAdapterRequest(name="gone", source=source), timeout=30)
            watch = asyncio.create_task(store_watch.watch(client, on_event))
            try:
                await _wait(lambda: "gone" in client.known_names, "the first listing")
                await stub.RegisterAdapter(pb.RegisterAdapterRequest(name="seen", source=source), timeout=30)
                await _wait(lambda: ("registered", "seen") in events, "an event (a last id to resume from)")
                # Cut off: meanwhile "gone" is deleted and far more events than the stream keeps follow.
                proxy.refuse = True
                proxy.cut_all()
                await stub.DeleteAdapter(pb.DeleteAdapterRequest(name="gone"), timeout=30)
                await asyncio.to_thread(_churn_at, address, source, 12)
                await stub.RegisterAdapter(pb.RegisterAdapterRequest(name="fresh", source=source), timeout=30)
                proxy.refuse = False
                await _wait(lambda: "fresh" in client.known_names, "the watcher to reconnect")
                await _wait(lambda: "gone" not in client.known_names, "the trimmed delete to be noticed")
                assert ("deleted", "gone") in events
                assert {"seen", "fresh"} <= client.known_names
            finally:
                watch.cancel()
                await client.close()

    try:
        asyncio.run(scenario())
    finally:
        proxy.close()


def _churn_at(address: str, source: str, events: int) -> None:
    with store_stub(address) as stub:
        churn(stub, source, events)


def test_a_stream_older_than_the_event_count_is_never_taken_for_untrimmed(store):
    """A store upgraded over a stream that has no count yet (or a count lost) starts the count past
    the stream's length: "added == length" (nothing trimmed) must never hold by coincidence while
    the count catches up, or a watcher resuming from a trimmed id would skip the gap."""
    address, source, server = store
    r = redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)
    with store_stub(address) as stub:
        churn(stub, source, 2)  # "churn" deleted
        r.delete("loraplex:events_added")  # a stream from before events were counted
        for i in range(12):
            if i % 2 == 0:
                stub.RegisterAdapter(pb.RegisterAdapterRequest(name="churn", source=source), timeout=30)
            else:
                stub.DeleteAdapter(pb.DeleteAdapterRequest(name="churn"), timeout=30)
            assert int(r.get("loraplex:events_added")) > r.xlen("loraplex:events"), "counted as untrimmed"
        # A resume from before the stream's first entry is still told to resync.
        assert first_events(stub, "1-0", 1)[0].type == "resync"
