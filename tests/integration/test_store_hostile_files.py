"""Local sources laid out by a hostile or careless caller: special files, symlinks out of the
allowed directories, loops, deeply nested JSON, values the inference server refuses. Each is
INVALID_ARGUMENT at once (never a hang, INTERNAL or UNAVAILABLE), and no error echoes file bytes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.local_files import Stopped, copy_regular_file
from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import (
    CONFIG,
    WEIGHTS,
    copy_adapter,
    edit_config,
    pull,
    read_safetensors,
    start_store,
    start_store_process,
    store_stub,
    write_random_adapter,
    write_safetensors,
)

SECRET = b"root:x:0:0:root:/root:/bin/bash\n" * 4


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-hostile", r=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(the allowed directory, a directory outside it holding a secret)."""
    root = tmp_path_factory.mktemp("hostile")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    return allowed, outside


@pytest.fixture(scope="module")
def stub(tmp_path_factory, tiny_llama_path, dirs):
    with (
        start_store(
            tmp_path_factory.mktemp("store-hostile"),
            "--base-model",
            str(tiny_llama_path),
            "--allowed-local-dirs",
            str(dirs[0]),
            "--max-adapter-bytes",
            str(4 << 20),
        ) as proc,
        store_stub(proc.address) as stub,
    ):
        yield stub
        assert "internal error" not in proc.output()


@pytest.fixture(scope="module")
def open_stub(tmp_path_factory, tiny_llama_path):
    """A store with no allow-list (the default): only the file checks stand between it and a device."""
    with (
        start_store(tmp_path_factory.mktemp("store-open"), "--max-adapter-bytes", str(4 << 20)) as proc,
        store_stub(proc.address) as stub,
    ):
        yield stub
        assert "internal error" not in proc.output()


def _refused(stub, source: str, *, within_s: float = 20.0) -> str:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="hostile", source=source), timeout=within_s)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert time.monotonic() - start < within_s
    details = e.value.details()
    assert "root:x" not in details and str(struct.unpack("<Q", SECRET[:8])[0]) not in details
    return details


def _with_weights(good: Path, d: Path, make) -> str:
    copy_adapter(good, d)
    (d / WEIGHTS).unlink()
    make(d / WEIGHTS)
    return str(d)


def test_weights_symlinked_to_a_device_is_refused(open_stub, stub, good, dirs):
    assert "outside" in _refused(
        stub, _with_weights(good, dirs[0] / "zero-confined", lambda p: p.symlink_to("/dev/zero"))
    )
    details = _refused(open_stub, _with_weights(good, dirs[0] / "zero", lambda p: p.symlink_to("/dev/zero")))
    assert "character device" in details


def test_weights_as_a_fifo_is_refused(stub, good, dirs):
    details = _refused(stub, _with_weights(good, dirs[0] / "fifo", os.mkfifo))
    assert "named pipe" in details


def test_file_symlink_out_of_the_allowed_dirs_is_refused(stub, good, dirs):
    details = _refused(
        stub, _with_weights(good, dirs[0] / "escape", lambda p: p.symlink_to(dirs[1] / "passwd"))
    )
    assert "outside --allowed-local-dirs" in details


def test_header_length_is_never_echoed(open_stub, good, tmp_path):
    # No allow-list: the file is read, and its first 8 bytes must not come back as a number.
    d = copy_adapter(good, tmp_path / "leak")
    (d / WEIGHTS).write_bytes(SECRET)
    assert "header length" in _refused(open_stub, str(d))


def test_symlink_loop_and_nested_json_are_invalid_argument(stub, good, dirs):
    loop = dirs[0] / "loop"
    loop.symlink_to(loop)
    _refused(stub, str(loop))
    _refused(stub, "file://" + str(loop))
    d = copy_adapter(good, dirs[0] / "nested")
    (d / CONFIG).write_text("[" * 100_000)
    assert "nested too deeply" in _refused(stub, str(d))
    d = copy_adapter(good, dirs[0] / "nested-header")
    (d / WEIGHTS).write_bytes(struct.pack("<Q", 100_000) + b"[" * 100_000)
    _refused(stub, str(d))


def test_what_inference_refuses_the_store_refuses(stub, good, dirs):
    d = copy_adapter(good, dirs[0] / "inf-alpha")
    edit_config(d, lora_alpha=12345)
    (d / CONFIG).write_text((d / CONFIG).read_text().replace("12345", "Infinity"))
    assert json.loads((d / CONFIG).read_text())["lora_alpha"] == float("inf")
    assert "lora_alpha" in _refused(stub, str(d))
    d = copy_adapter(good, dirs[0] / "huge-alpha")  # finite, but past a float32 scaling
    edit_config(d, lora_alpha=1e308)
    assert "lora_alpha" in _refused(stub, str(d))
    d = copy_adapter(good, dirs[0] / "inf-pattern")
    edit_config(d, alpha_pattern={"q_proj": float("inf")})
    _refused(stub, str(d))
    d = copy_adapter(good, dirs[0] / "dora")
    edit_config(d, fan_in_fan_out=True)
    assert "fan_in_fan_out" in _refused(stub, str(d))
    d = copy_adapter(good, dirs[0] / "layer-minus-one")
    header, data = read_safetensors(d / WEIGHTS)
    renamed = {k.replace("layers.0.", "layers.-1."): v for k, v in header.items()}
    write_safetensors(d / WEIGHTS, renamed, data)
    assert "layer" in _refused(stub, str(d))


def test_the_good_adapter_still_registers(stub, good, dirs):
    d = copy_adapter(good, dirs[0] / "fine")
    assert stub.RegisterAdapter(pb.RegisterAdapterRequest(name="fine", source=str(d)), timeout=60).rank == 4


def test_copy_stops_at_the_byte_limit_and_when_told(tmp_path):
    src = tmp_path / "big"
    src.write_bytes(b"\0" * (3 << 20))
    with pytest.raises(InvalidArgument, match="past"):
        copy_regular_file(src, tmp_path / "out", 2 << 20)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        copy_regular_file(src, tmp_path / "out", 8 << 20, stop.is_set)
    assert copy_regular_file(src, tmp_path / "out", 8 << 20) == 3 << 20


_STALLED_PULL = """
import sys, time, grpc
from loraplex.v1 import adapter_store_pb2 as pb, adapter_store_pb2_grpc as pb_grpc
# No BDP probing: the receive window stays near 64 KiB. With it, a loaded machine's long round trips
# grew the window past the whole file, the pull finished before the kill, and nothing ended early.
channel = grpc.insecure_channel(sys.argv[1], options=[("grpc.http2.bdp_probe", 0)])
stub = pb_grpc.AdapterStoreStub(channel)
stream = stub.PullAdapter(pb.PullAdapterRequest(name="big"))
next(stream)
print("pulling", flush=True)
time.sleep(60)
"""


def test_a_client_killed_mid_pull_is_one_info_line(tmp_path):
    big = write_random_adapter(tmp_path / "big", hidden=2048, r=64)  # ~16 MiB: many chunks
    with start_store(tmp_path / "cache") as proc, store_stub(proc.address) as stub:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="big", source=str(big)), timeout=60)
        client = subprocess.Popen(
            [sys.executable, "-c", _STALLED_PULL, proc.address],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert client.stdout.readline().strip() == "pulling"
        client.kill()
        client.wait()
        deadline = time.monotonic() + 20
        while "the caller went away" not in proc.output():  # one INFO line, from grpc or from the servicer
            assert time.monotonic() < deadline, proc.output()[-2000:]
            time.sleep(0.2)
        assert pull(stub, "big")[1] == (big / WEIGHTS).read_bytes()  # the store serves on
    assert "Traceback" not in proc.output() and "ERROR" not in proc.output(), proc.output()[-3000:]


def test_a_copy_stops_when_its_caller_goes_away(tmp_path, good):
    d = copy_adapter(good, tmp_path / "huge")
    with open(d / WEIGHTS, "r+b") as f:
        f.truncate(1 << 30)  # sparse: nothing to write here, a gigabyte to copy there
    with start_store(tmp_path / "cache") as proc, store_stub(proc.address) as stub:
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAdapter(pb.RegisterAdapterRequest(name="huge", source=str(d)), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 20
        while "fetch for huge abandoned by its caller" not in proc.output():
            assert time.monotonic() < deadline, proc.output()[-2000:]
            time.sleep(0.1)
        assert "abandoned (caller gone or store shutting down)" in proc.output()  # stopped mid-copy
        assert not list((tmp_path / "cache" / "staging").iterdir())


def test_shutdown_stops_a_copy_in_progress(tmp_path, good):
    d = copy_adapter(good, tmp_path / "huge")
    with open(d / WEIGHTS, "r+b") as f:
        f.truncate(1 << 30)
    proc = start_store_process(tmp_path / "cache", "--grace", "30")
    outcome: dict = {}

    def register() -> None:
        with store_stub(proc.address) as stub:
            try:
                stub.RegisterAdapter(pb.RegisterAdapterRequest(name="huge", source=str(d)), timeout=60)
            except grpc.RpcError as e:
                outcome["code"], outcome["details"] = e.code(), e.details()

    worker = threading.Thread(target=register)
    try:
        worker.start()
        deadline = time.monotonic() + 20
        while "fetching file://" not in proc.output():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        assert proc.stop() == 0
        worker.join(30)
    finally:
        proc.stop()
    # Without the stop the whole gigabyte is copied, then refused as INVALID_ARGUMENT (no header).
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE and "abandoned" in outcome["details"], outcome
    assert time.monotonic() - start < 20


def test_adapter_may_not_take_the_base_models_name(stub, good, dirs, tiny_llama_path):
    # /v1/models would list the id twice, and the door (base model) and gRPC (adapter) disagree.
    source = str(copy_adapter(good, dirs[0] / "shadow"))
    for name in (tiny_llama_path.name, tiny_llama_path.name.upper()):
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAdapter(pb.RegisterAdapterRequest(name=name, source=source), timeout=20)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "base model" in e.value.details()
    record = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="not-the-model", source=source), timeout=20)
    assert record.name == "not-the-model"
