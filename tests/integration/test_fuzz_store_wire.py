"""Property test: bytes that are not (quite) a request message, at the adapter store.

Random bytes and damaged encodings of real requests go to every unary-request method; each
must get a status other than UNKNOWN/INTERNAL and the store must stay SERVING. (Field-level
fuzzing of the store is tests/integration/test_store_fuzz.py.) The Hub endpoint points at a closed port
and local sources are confined to an empty directory, so a random request that happens to
parse touches nothing outside the test.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.v1 import adapter_store_pb2 as spb
from loraplex.v1 import adapter_store_pb2_grpc as spb_grpc
from tests.support.store_helpers import start_store

REQUESTS = {
    "RegisterAdapter": spb.RegisterAdapterRequest(name="wire", source="/nowhere/adapter", revision="main"),
    "GetAdapter": spb.GetAdapterRequest(name="wire"),
    "ListAdapters": spb.ListStoreAdaptersRequest(page_token="abc"),
    "DeleteAdapter": spb.DeleteAdapterRequest(name="wire"),
    "PullAdapter": spb.PullAdapterRequest(name="wire"),
}
NOT_CLEAN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
MAX_WATCHERS = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    empty = tmp_path_factory.mktemp("allowed-empty")
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    with (
        start_store(
            tmp_path_factory.mktemp("wire-store"),
            "--allowed-local-dirs",
            str(empty),
            "--max-watchers",
            str(MAX_WATCHERS),
            env=env,
        ) as proc,
        grpc.insecure_channel(proc.address) as channel,
    ):
        yield proc, channel


@st.composite
def wire_bytes(draw):
    method = draw(st.sampled_from(sorted(REQUESTS)))
    raw = bytearray(REQUESTS[method].SerializeToString())
    how = draw(st.sampled_from(["random", "flip", "cut", "append"]))
    if how == "random":
        raw = bytearray(draw(st.binary(max_size=64)))
    elif how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    elif how == "cut":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    else:
        raw += draw(st.binary(min_size=1, max_size=16))
    return method, bytes(raw)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(call=wire_bytes())
def test_undecodable_store_requests_get_clean_status(store, call):
    _, channel = store
    method, raw = call
    path = f"/loraplex.v1.AdapterStore/{method}"
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if method == "PullAdapter":
            list(channel.unary_stream(path, **identity)(raw, timeout=30))
        else:
            channel.unary_unary(path, **identity)(raw, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert code not in NOT_CLEAN, (method, raw, code, err.details())
    event(f"{method}: {code.name}")


event_ids = st.one_of(
    st.just(""),
    st.just("0"),
    st.sampled_from(
        ["99999999999999999999999-0", "18446744073709551616", "1-18446744073709551616", "-1", "1-2-3"]
    ),
    st.from_regex(r"\A[0-9]{1,25}(-[0-9]{1,25})?\Z"),
    st.text(max_size=30),
)


@settings(
    max_examples=6,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ids=st.lists(event_ids, min_size=1, max_size=MAX_WATCHERS + 8))
def test_many_watchers_from_any_event_id_get_clean_status(store, ids):
    proc, _ = store
    allowed = {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }

    async def watch_all() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = spb_grpc.AdapterStoreStub(channel)
            calls = [stub.WatchAdapters(spb.WatchAdaptersRequest(last_event_id=i), timeout=1.0) for i in ids]
            codes = []
            for call in calls:
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as err:
                    assert err.code() in allowed, (err.code(), err.details())
                    codes.append(err.code())
            return codes

    codes = asyncio.run(watch_all())
    event(f"refused: {codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 0}")
    if len(ids) <= MAX_WATCHERS:
        assert grpc.StatusCode.RESOURCE_EXHAUSTED not in codes  # watchers of earlier examples were let go


def test_store_healthy_after_wire_fuzzing(store):
    proc, channel = store
    assert proc.proc.poll() is None
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "internal error" not in proc.output(), proc.output()[-3000:]
