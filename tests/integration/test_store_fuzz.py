"""Property tests: random malformed requests and random broken adapter files get a clean
status (never INTERNAL/UNKNOWN) and the store stays healthy and keeps serving a good adapter."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import CONFIG, WEIGHTS, copy_adapter, pull, start_store, store_stub

CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAVAILABLE,
}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-fuzz", r=4)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama_path, good):
    # A closed port as the Hub: Hub-looking sources fail fast with UNAVAILABLE.
    with (
        start_store(
            tmp_path_factory.mktemp("store-fuzz"),
            "--base-model",
            str(tiny_llama_path),
            env={"HF_ENDPOINT": "http://127.0.0.1:9"},
        ) as proc,
        store_stub(proc.address) as stub,
    ):
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="anchor", source=str(good)), timeout=60)
        yield proc, stub


def _register(stub, name, source, revision=""):
    try:
        stub.RegisterAdapter(
            pb.RegisterAdapterRequest(name=name, source=source, revision=revision), timeout=30
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() in CLEAN, (e.code(), e.details())
        assert e.details(), "an error must say what is wrong"
        return e.code()


sources = st.one_of(
    st.text(max_size=300),
    st.sampled_from(
        [
            " /etc",
            "\t/tmp",
            "file:///%2E%2E/etc",
            "file:///tmp/%2e%2e/%2e%2e/dev",
            "file://remote/x",
            "file:///dev/zero",
            "/dev/zero",
            "/proc/self/fd/0",
            "file:///%00",
            "file://" + "%2F" * 200,
            " " * 5000,
        ]
    ),
    st.text(max_size=60).map(lambda t: "file:///" + "".join(f"%{ord(c) & 0xFF:02X}" for c in t)),
)


@FUZZ
@given(
    name=st.one_of(st.text(max_size=140), st.just("x" * 5000)), source=sources, revision=st.text(max_size=40)
)
def test_random_requests_get_clean_errors(store, name, source, revision):
    _, stub = store
    _register(stub, name, source, revision)
    for call in (
        lambda: stub.GetAdapter(pb.GetAdapterRequest(name=name), timeout=10),
        lambda: stub.DeleteAdapter(pb.DeleteAdapterRequest(name=name + "-x"), timeout=10),
        lambda: stub.ListAdapters(pb.ListStoreAdaptersRequest(page_token=name, page_size=3), timeout=10),
    ):
        try:
            call()
        except grpc.RpcError as e:
            assert e.code() in CLEAN, (e.code(), e.details())


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(
        st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8)
    ),
    st.tuples(st.just("header_len"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(
        st.just("special"),
        st.sampled_from(
            ["fifo", "devzero", "devnull", "dir", "loop", "dangling", "config_fifo", "config_loop"]
        ),
    ),
    st.tuples(
        st.just("nested"), st.sampled_from(["config", "header"]), st.sampled_from([100, 1000, 100_000])
    ),
    st.tuples(
        st.just("config"),
        st.sampled_from(["r", "lora_alpha", "alpha_pattern"]),
        st.sampled_from([float("inf"), -float("inf"), float("nan"), 1e308, 5e-324, 2**63, {"q_proj": 1e999}]),
    ),
    st.tuples(
        st.just("config"),
        st.sampled_from(["r", "lora_alpha", "target_modules", "peft_type", "rank_pattern"]),
        st.one_of(
            st.none(),
            st.integers(-5, 100),
            st.floats(allow_nan=True),
            st.text(max_size=8),
            st.lists(st.text(max_size=8), max_size=3),
            st.dictionaries(st.text(max_size=8), st.integers(-2, 9), max_size=2),
        ),
    ),
)


@FUZZ
@given(mut=mutation, header_bias=st.booleans())
def test_random_broken_adapters_are_refused_cleanly(store, good, mut, header_bias):
    proc, stub = store
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_adapter(good, Path(tmp) / "a")
        raw = bytearray((d / WEIGHTS).read_bytes())
        (header_len,) = struct.unpack("<Q", raw[:8])
        span = 8 + header_len if header_bias else len(raw)  # most checks live in the header
        kind = mut[0]
        if kind == "truncate":
            raw = raw[: int(mut[1] * len(raw))]
        elif kind == "flip":
            for where, value in mut[1]:
                raw[min(int(where * span), len(raw) - 1)] = value
        elif kind == "header_len":
            raw[:8] = struct.pack("<Q", mut[1])
        elif kind == "append":
            raw += mut[1]
        elif kind == "nested":
            depth = mut[2]
            if mut[1] == "config":
                (d / CONFIG).write_text("[" * depth)
            else:
                raw = bytearray(struct.pack("<Q", depth) + b"[" * depth)
        elif kind == "special":
            _special(d, mut[1])
            assert _register(stub, "fuzzed", str(d)) == grpc.StatusCode.INVALID_ARGUMENT, mut
            return
        else:
            cfg = json.loads((d / CONFIG).read_text())
            cfg[mut[1]] = mut[2]
            (d / CONFIG).write_text(json.dumps(cfg))
        (d / WEIGHTS).write_bytes(bytes(raw))
        code = _register(stub, "fuzzed", str(d))
        if code == grpc.StatusCode.OK:  # e.g. a flip inside the data that left every value finite
            stub.DeleteAdapter(pb.DeleteAdapterRequest(name="fuzzed"))
        shutil.rmtree(d)


def _special(d: Path, kind: str) -> None:
    target = d / (CONFIG if kind.startswith("config_") else WEIGHTS)
    target.unlink()
    if kind in ("fifo", "config_fifo"):
        os.mkfifo(target)
    elif kind in ("devzero", "devnull"):
        target.symlink_to(f"/dev/{kind[3:]}")
    elif kind == "dir":
        target.mkdir()
    elif kind in ("loop", "config_loop"):
        target.symlink_to(target)
    else:
        target.symlink_to(d / "nowhere")


def test_store_still_healthy_and_serving_after_fuzz(store, good):
    proc, stub = store
    with grpc.insecure_channel(proc.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert pull(stub, "anchor")[1] == (good / WEIGHTS).read_bytes()
    assert "internal error" not in proc.output()
