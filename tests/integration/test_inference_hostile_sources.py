"""The inference server with an adapter store and --allowed-local-dirs, as a hostile or careless
caller finds it: sources the store reads differently from how they look, symlinked files, special
files, loops, bad names; leftover pulls of a killed server; concurrent and repeated reloads."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from loraplex.v1 import adapter_store_pb2 as store_pb
from loraplex.v1 import adapter_store_pb2_grpc as store_grpc
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import start_inference, start_store
from tests.support.store_helpers import CONFIG, WEIGHTS, copy_adapter, edit_config

PROMPT = "The capital of France is"
NEW = 8


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path, "hostile-inf", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=5
    )


@pytest.fixture(scope="module")
def rank8(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "hostile-inf-r8", r=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def layout(tmp_path_factory, good) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-inf")
    allowed, outside, cache = root / "allowed", root / "outside", root / "inference-cache"
    allowed.mkdir()
    copy_adapter(good, outside)
    # What a server SIGKILLed mid-pull leaves, and a directory of the weights-only layout.
    cache.mkdir()
    (cache / ".pull-999999999-dead").mkdir()
    (cache / ".pull-999999999-dead" / WEIGHTS).write_bytes(b"half")
    (cache / ".pull-x1y2").mkdir()
    (cache / ("ab" * 32)).mkdir()
    (cache / f".pull-{os.getpid()}-live").mkdir()  # a live process's pull: kept
    return {"root": root, "allowed": allowed, "outside": outside, "cache": cache}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_path, layout):
    store = start_store(tmp_path_factory.mktemp("hostile-inf-store"), tiny_llama_path)
    try:
        inference = start_inference(
            tiny_llama_path,
            "--allowed-local-dirs",
            str(layout["allowed"]),
            "--max-lora-rank",
            "4",
            store=store,
            cache=layout["cache"],
        )
    except Exception:
        store.stop()
        raise
    with grpc.insecure_channel(inference.address) as ch, grpc.insecure_channel(store.address) as sch:
        yield inference, pb_grpc.InferenceStub(ch), store_grpc.AdapterStoreStub(sch)
    inference.stop()
    store.stop()
    assert "internal error" not in inference.output() + store.output()


def _load(stub, name: str, source: str, timeout: float = 60) -> tuple[grpc.StatusCode, str, object]:
    try:
        return (
            grpc.StatusCode.OK,
            "",
            stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source=source), timeout=timeout).adapter,
        )
    except grpc.RpcError as e:
        return e.code(), e.details(), None


def _tokens(stub, name: str, n: int = 1) -> list[list[int]]:
    params = pb.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    out = stub.Generate(
        pb.GenerateRequest(text=[PROMPT] * n, adapter=[name], sampling_params=params), timeout=60
    )
    return [list(c.token_ids) for c in out.completions]


def test_leftover_pulls_are_removed_at_start(stack, layout):
    left = sorted(p.name for p in layout["cache"].iterdir())
    assert left == [f".pull-{os.getpid()}-live"]


def test_sources_are_checked_as_the_store_reads_them(stack, layout):
    _, stub, store = stack
    allowed, outside = layout["allowed"], layout["outside"]
    for source in (
        " " + str(outside),
        f" file://{outside}",
        f"file://{allowed}/%2E%2E/{outside.name}",
        f"file://localhost{allowed}/%2e%2e/{outside.name}",
        f"{allowed}/../{outside.name} ",
    ):
        code, details, _ = _load(stub, "escape", source)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--allowed-local-dirs" in details, (
            source,
            details,
        )
    with pytest.raises(grpc.RpcError) as e:
        store.GetAdapter(store_pb.GetAdapterRequest(name="escape"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # nothing reached the store


def test_a_symlinked_file_cannot_lead_out(stack, layout, good):
    _, stub, _ = stack
    d = layout["allowed"] / "linked"
    d.mkdir()
    shutil.copyfile(good / CONFIG, d / CONFIG)
    (d / WEIGHTS).symlink_to(layout["outside"] / WEIGHTS)
    code, details, _ = _load(stub, "linked", str(d))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--allowed-local-dirs" in details, details


def test_special_files_loops_and_nested_json_are_invalid_argument(stack, layout, good):
    _, stub, _ = stack
    fifo = copy_adapter(good, layout["allowed"] / "fifo")
    (fifo / WEIGHTS).unlink()
    os.mkfifo(fifo / WEIGHTS)
    loop = layout["allowed"] / "loop"
    loop.symlink_to(loop)
    nested = copy_adapter(good, layout["allowed"] / "nested")
    (nested / CONFIG).write_text("[" * 100_000)
    for source in (str(fifo), str(loop), f"file://{loop}", str(nested)):
        start = time.monotonic()
        code, details, _ = _load(stub, "odd", source, timeout=30)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (source, code, details)
        assert time.monotonic() - start < 20


def test_a_bad_name_for_all_texts_is_invalid_argument(stack):
    inference, stub, _ = stack
    for name in ("x" * 5000, "../etc", "a b"):
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(text=["a", "b"], adapter=[name]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter name" in e.value.details()
    assert "x" * 200 not in inference.output()


def test_rank_over_the_limit_keeps_the_store_registration(stack, layout, rank8):
    _, stub, store = stack
    code, details, _ = _load(stub, "too-big", str(copy_adapter(rank8, layout["allowed"] / "too-big")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--max-lora-rank" in details
    assert "keeps 'too-big' registered" in details
    assert store.GetAdapter(store_pb.GetAdapterRequest(name="too-big"), timeout=10).rank == 8


def test_concurrent_loads_of_one_name_each_report_their_own(stack, layout, good):
    _, stub, _ = stack
    sources = []
    for alpha in range(1, 10):
        d = copy_adapter(good, layout["allowed"] / f"alpha-{alpha}")
        edit_config(d, lora_alpha=alpha)
        sources.append((alpha, str(d)))
    results: dict[int, tuple] = {}
    threads = [
        threading.Thread(target=lambda a=a, s=s: results.__setitem__(a, _load(stub, "contested", s)))
        for a, s in sources
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for alpha, (code, details, info) in results.items():
        assert code == grpc.StatusCode.OK, details
        assert (
            info.alpha == alpha
            and info.digest == "sha256:" + hashlib.sha256((good / WEIGHTS).read_bytes()).hexdigest()
        )
    assert len(results) == 9


def test_one_call_sees_one_version_of_an_adapter(stack, layout, good):
    _, stub, _ = stack
    low = copy_adapter(good, layout["allowed"] / "flip-low")
    edit_config(low, lora_alpha=1)
    high = copy_adapter(good, layout["allowed"] / "flip-high")
    versions = []
    for source in (high, low):
        assert _load(stub, "flip", str(source))[0] == grpc.StatusCode.OK
        versions.append(_tokens(stub, "flip")[0])
    assert versions[0] != versions[1], "the two versions must differ for this test to mean anything"
    stop = threading.Event()

    def reload() -> None:
        i = 0
        while not stop.is_set():
            _load(stub, "flip", str((high, low)[i % 2]))
            i += 1

    reloader = threading.Thread(target=reload)
    reloader.start()
    try:
        for _ in range(12):
            outputs = _tokens(stub, "flip", 4)
            assert outputs[0] in versions and all(o == outputs[0] for o in outputs), outputs
    finally:
        stop.set()
        reloader.join(60)
