"""The store across restarts and faults: records and blobs survive a restart; a Redis lost
and restarted empty is rebuilt by --reindex; Redis stopped under a running store gives
UNAVAILABLE and the store recovers by itself; LRU eviction under --cache-max-bytes never
takes a blob being pulled; --allow-pickle converts; --allowed-local-dirs confines sources."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.support.store_helpers import (
    WEIGHTS,
    RedisServer,
    copy_adapter,
    pull,
    sha256_file,
    start_store,
    store_stub,
    write_random_adapter,
)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory) -> dict[str, Path]:
    return {n: adapter_factory(tiny_llama_path, f"dur-{n}", r=4, seed=i) for i, n in enumerate(("a", "b"))}


@pytest.fixture()
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.close()


def register(stub, name, source):
    return stub.RegisterAdapter(pb.RegisterAdapterRequest(name=name, source=str(source)), timeout=60)


def names(stub) -> list[str]:
    return [a.name for a in stub.ListAdapters(pb.ListStoreAdaptersRequest(page_size=1000)).adapters]


def test_restart_keeps_records_and_blobs(tmp_path, adapters):
    cache = tmp_path / "cache"
    with start_store(cache) as proc, store_stub(proc.address) as stub:
        before = {n: register(stub, n, adapters[n]) for n in ("a", "b")}
    with start_store(cache) as proc, store_stub(proc.address) as stub:
        assert names(stub) == ["a", "b"]
        for n, record in before.items():
            after = stub.GetAdapter(pb.GetAdapterRequest(name=n))
            assert (after.digest, after.generation, after.created_at) == (
                record.digest,
                record.generation,
                record.created_at,
            )
            assert pull(stub, n)[1] == (adapters[n] / WEIGHTS).read_bytes()


def test_redis_lost_then_reindex_restores_from_sidecars(tmp_path, adapters, redis_server):
    cache = tmp_path / "cache"
    flags = ("--redis-url", redis_server.url, "--key-prefix", "lpxtest:")
    with start_store(cache, *flags) as proc, store_stub(proc.address) as stub:
        a = register(stub, "keep-a", adapters["a"])
        register(stub, "keep-b", adapters["b"])
        register(stub, "gone", adapters["b"])
        stub.DeleteAdapter(pb.DeleteAdapterRequest(name="gone"))
    redis_server.stop()
    redis_server.start(empty=True)
    with start_store(cache, *flags) as proc, store_stub(proc.address) as stub:
        assert names(stub) == []
        assert "--reindex" in proc.output()  # the store says how to get them back
    with start_store(cache, *flags, "--reindex") as proc, store_stub(proc.address) as stub:
        assert names(stub) == ["keep-a", "keep-b"]
        restored = stub.GetAdapter(pb.GetAdapterRequest(name="keep-a"))
        assert (restored.digest, restored.generation, restored.source) == (a.digest, a.generation, a.source)
        assert pull(stub, "keep-b")[1] == (adapters["b"] / WEIGHTS).read_bytes()
        # Generations keep counting from the restored ones.
        assert register(stub, "keep-a", adapters["b"]).generation == a.generation + 1


def test_redis_stopped_while_running_then_recovers(tmp_path, adapters, redis_server):
    with (
        start_store(tmp_path / "cache", "--redis-url", redis_server.url) as proc,
        store_stub(proc.address) as stub,
    ):
        register(stub, "outage", adapters["a"])
        redis_server.stop()
        for call in (
            lambda: stub.GetAdapter(pb.GetAdapterRequest(name="outage"), timeout=30),
            lambda: register(stub, "outage-2", adapters["b"]),
            lambda: stub.ListAdapters(pb.ListStoreAdaptersRequest(), timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in e.value.details()
        with grpc.insecure_channel(proc.address) as ch:  # the process itself is alive
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        redis_server.start()  # same data dir (append-only file): the record is still there
        deadline = time.monotonic() + 15
        while True:
            try:
                record = stub.GetAdapter(pb.GetAdapterRequest(name="outage"), timeout=5)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.2)
        assert record.digest == sha256_file(adapters["a"] / WEIGHTS)
        assert register(stub, "outage-2", adapters["b"]).name == "outage-2"


def test_lru_eviction_spares_a_blob_being_pulled_and_refetches_evicted(tmp_path):
    srcs = {
        n: write_random_adapter(tmp_path / n, hidden=1024, layers=4, r=32, seed=i)  # ~2 MiB each
        for i, n in enumerate(("e1", "e2", "e3"))
    }
    size = (srcs["e1"] / WEIGHTS).stat().st_size
    cache = tmp_path / "cache"
    blob = lambda n: cache / "blobs" / "sha256" / sha256_file(srcs[n] / WEIGHTS).removeprefix("sha256:")  # noqa: E731
    with (
        start_store(cache, "--cache-max-bytes", str(int(size * 2.5))) as proc,
        store_stub(proc.address) as stub,
    ):
        register(stub, "e1", srcs["e1"])
        register(stub, "e2", srcs["e2"])
        # Hold a pull of e1 open: its blob is pinned. A 64 KiB flow-control window (no BDP
        # probing) keeps the server mid-file while this client reads nothing past the header.
        slow = grpc.insecure_channel(proc.address, options=[("grpc.http2.bdp_probe", 0)])
        stream = pb_grpc.AdapterStoreStub(slow).PullAdapter(pb.PullAdapterRequest(name="e1"), timeout=60)
        first = next(stream)
        assert first.WhichOneof("payload") == "header"
        pull(stub, "e2", shared_cache=True)  # e2 used after e1: e1 is now the least recently used
        register(stub, "e3", srcs["e3"])  # over budget: LRU e1 would go, but it streams, so e2 goes
        assert blob("e1").exists() and blob("e3").exists() and not blob("e2").exists()
        data = b"".join(c.data for c in stream)
        slow.close()
        assert data == (srcs["e1"] / WEIGHTS).read_bytes()
        # The evicted e2 keeps its record; pulling it fetches it again from its source, same digest.
        assert stub.GetAdapter(pb.GetAdapterRequest(name="e2")).digest == sha256_file(srcs["e2"] / WEIGHTS)
        assert pull(stub, "e2")[1] == (srcs["e2"] / WEIGHTS).read_bytes()
        assert blob("e2").exists() and "re-fetched evicted e2" in proc.output()
        total = sum(p.stat().st_size for p in (cache / "blobs" / "sha256").iterdir() if p.suffix != ".json")
        assert total <= size * 2.5


def test_evicted_adapter_whose_source_changed_is_failed_precondition(tmp_path, adapters):
    src = copy_adapter(adapters["a"], tmp_path / "changing")
    size = (src / WEIGHTS).stat().st_size
    with (
        start_store(tmp_path / "cache", "--cache-max-bytes", str(int(size * 1.5))) as proc,
        store_stub(proc.address) as stub,
    ):
        register(stub, "changing", src)
        register(stub, "other", adapters["b"])  # evicts "changing"'s blob
        copy_adapter(adapters["b"], src)
        with pytest.raises(grpc.RpcError) as e:
            pull(stub, "changing")
        assert (
            e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "RegisterAdapter" in e.value.details()
        )


def test_allow_pickle_converts_and_local_dirs_are_confined(tmp_path, adapters):
    import torch
    from safetensors.torch import load_file

    allowed = tmp_path / "allowed"
    pickled = copy_adapter(adapters["a"], allowed / "pickled")
    state = load_file(str(pickled / WEIGHTS))
    torch.save(state, pickled / "adapter_model.bin")
    (pickled / WEIGHTS).unlink()
    outside = copy_adapter(adapters["b"], tmp_path / "outside")
    (allowed / "link").symlink_to(outside)
    with (
        start_store(tmp_path / "cache", "--allow-pickle", "--allowed-local-dirs", str(allowed)) as proc,
        store_stub(proc.address) as stub,
    ):
        record = register(stub, "from-pickle", pickled)
        _, data = pull(stub, "from-pickle")
        converted = tmp_path / "converted.safetensors"
        converted.write_bytes(data)
        got = load_file(str(converted))
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
        assert record.dtype == "F32"
        for source in (outside, allowed / "link", allowed / ".." / "outside", f"file://{outside}"):
            with pytest.raises(grpc.RpcError) as e:
                register(stub, "escape", source)
            assert (
                e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "allowed-local-dirs" in e.value.details()
            )


def test_sigterm_drains_an_open_pull_then_exits_zero(tmp_path):
    src = write_random_adapter(tmp_path / "drain", hidden=1024, layers=4, r=64)  # ~4 MiB
    with start_store(tmp_path / "cache", "--grace", "20") as proc, store_stub(proc.address) as stub:
        register(stub, "drain", src)
        stream = stub.PullAdapter(pb.PullAdapterRequest(name="drain"), timeout=60)
        header = next(stream).header
        proc.proc.terminate()  # SIGTERM with a pull in flight
        data = b"".join(c.data for c in stream)
        assert sha256_file(src / WEIGHTS) == header.record.digest
        assert data == (src / WEIGHTS).read_bytes()
        assert proc.proc.wait(30) == 0


def test_sigterm_ends_open_watch_streams_promptly(tmp_path):
    with start_store(tmp_path / "cache", "--grace", "30") as proc, store_stub(proc.address) as stub:
        stream = stub.WatchAdapters(pb.WatchAdaptersRequest(last_event_id="0"), timeout=60)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.proc.terminate()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "last_event_id" in e.value.details()
        assert proc.proc.wait(30) == 0 and time.monotonic() - t0 < 10  # not the 30 s grace


def test_embedded_redis_killed_is_restarted_with_its_data(tmp_path, adapters):
    with start_store(tmp_path / "cache") as proc, store_stub(proc.address) as stub:
        record = register(stub, "survivor", adapters["a"])
        time.sleep(1.2)  # appendfsync everysec: the registration is on disk
        pid = int(re.search(r"embedded Redis \(pid (\d+)\)", proc.output()).group(1))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:  # calls fail for a moment, then the restarted server answers from its files
            try:
                again = stub.GetAdapter(pb.GetAdapterRequest(name="survivor"), timeout=5)
                if "restarted" in proc.output():
                    break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert time.monotonic() < deadline, "the store never recovered from losing its embedded Redis"
            time.sleep(0.2)
        assert again.digest == record.digest and again.generation == record.generation
        register(stub, "after", adapters["b"])
        assert sorted(names(stub)) == ["after", "survivor"]
        with grpc.insecure_channel(proc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "embedded Redis died" in proc.output()
