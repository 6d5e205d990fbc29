"""Property test (issue 59, H3 / M6): adapter tensors with non-finite or huge values, or of a dtype an
adapter may not hold, loaded through the real servers, are refused cleanly (INVALID_ARGUMENT naming the
tensor) by both load paths: the adapter store's RegisterAdapter and a store-less inference server's
LoadAdapter (which reads the directory itself, as `--lora-paths` does). The base model's greedy output
is unchanged after every attempt, and the largest weight allowed (float16's largest value) still loads.

One store and one store-less inference server on the tiny Llama for the module.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import adapter_store_pb2 as store_pb
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S
from tests.support.store_helpers import start_store, store_stub

WEIGHTS = "adapter_model.safetensors"
FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BAD_DTYPES = {"F64": torch.float64, "I8": torch.int8, "I32": torch.int32, "U8": torch.uint8}
EDGE = {"F32": 65504.0, "F16": 65504.0, "BF16": 65280.0}  # the largest allowed each dtype holds exactly
BASE_PARAMS = pb.SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "fuzz-values", r=4, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama_path):
    with start_store(tmp_path_factory.mktemp("fuzz-values-store"), "--base-model", str(tiny_llama_path)) as p:
        with store_stub(p.address) as stub:
            yield stub


@pytest.fixture(scope="module")
def inference(tmp_path_factory, tiny_llama_path):
    allowed = tmp_path_factory.mktemp("fuzz-values-allowed")
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        ["--model-path", str(tiny_llama_path), "--port", "0", "--device", "cpu", "--max-total-tokens", "1024"]
        + ["--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
        + ["--allowed-local-dirs", str(allowed)],
        echo=False,
    )
    try:
        proc.wait_serving(STARTUP_S)
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            stub.allowed = allowed
            stub.base = _base_tokens(stub)
            yield stub
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


def _base_tokens(stub) -> list[list[int]]:
    out = stub.Generate(
        pb.GenerateRequest(text=["The capital of France is", "def f(x):"], sampling_params=BASE_PARAMS),
        timeout=60,
    )
    return [list(c.token_ids) for c in out.completions]


@st.composite
def bad_tensors(draw):
    """(tensor index, file dtype, what goes in, how many places): every draw is an adapter to refuse."""
    kind = draw(st.sampled_from(["nan", "inf", "huge", "dtype"]))
    which = draw(st.integers(0, 15))
    if kind == "dtype":
        return which, draw(st.sampled_from(sorted(BAD_DTYPES))), None, "all"
    if kind == "huge":  # finite in float32, past float16's range (Inf in an F16 file)
        magnitude = draw(st.floats(min_value=7e4, max_value=3e38, allow_nan=False, allow_infinity=False))
        value = magnitude if draw(st.booleans()) else -magnitude
    else:
        value = float("nan") if kind == "nan" else draw(st.sampled_from([float("inf"), float("-inf")]))
    return which, draw(st.sampled_from(sorted(FLOATS))), value, draw(st.sampled_from(["one", "all"]))


def _write(adapter: Path, directory: Path, which: int, dtype: str, value: float | None, where: str) -> str:
    """A copy of `adapter` in `directory`, in `dtype`, with `value` in tensor `which`; returns its name."""
    shutil.copytree(adapter, directory)
    tensors = load_file(str(directory / WEIGHTS))
    key = sorted(tensors)[which % len(tensors)]
    target = {**FLOATS, **BAD_DTYPES}[dtype]
    tensors = {k: (t * 100 if not target.is_floating_point else t).to(target) for k, t in tensors.items()}
    if value is not None:
        flat = tensors[key].view(-1)
        cast = torch.tensor(value, dtype=torch.float64).to(flat.dtype)  # past float16's range: Inf
        if where == "all":
            flat.fill_(cast)
        else:
            flat[(which * 7) % flat.numel()] = cast
    save_file(tensors, str(directory / WEIGHTS))
    return key


def _code(call, request) -> tuple[grpc.StatusCode, str]:
    try:
        call(request, timeout=60)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details()


@settings(max_examples=24, **FUZZ)
@given(case=bad_tensors())
def test_non_finite_huge_and_wrong_dtype_tensors_are_refused_by_both_load_paths(
    adapter, store, inference, case
):
    which, dtype, value, where = case
    name = f"bad-{uuid.uuid4().hex[:8]}"
    directory = inference.allowed / name
    key = _write(adapter, directory, which, dtype, value, where)
    event(f"{dtype} {'dtype' if value is None else value} {where}")
    for service, call, request in (
        ("store", store.RegisterAdapter, store_pb.RegisterAdapterRequest(name=name, source=str(directory))),
        ("inference", inference.LoadAdapter, pb.LoadAdapterRequest(name=name, source=str(directory))),
    ):
        code, detail = _code(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (service, case, code, detail)
        assert key in detail or "dtype" in detail, (service, case, detail)  # names the tensor (or its dtype)
    code, _ = _code(
        inference.Generate, pb.GenerateRequest(text=["Hi"], adapter=[name], sampling_params=BASE_PARAMS)
    )
    assert code == grpc.StatusCode.NOT_FOUND  # nothing of the refused adapter was kept
    assert _base_tokens(inference) == inference.base
    shutil.rmtree(directory)


@pytest.mark.parametrize("dtype", sorted(FLOATS))
def test_the_largest_allowed_weight_loads_in_both_and_the_base_is_unchanged(adapter, store, inference, dtype):
    name = f"edge-{dtype.lower()}"
    directory = inference.allowed / name
    _write(adapter, directory, 3, dtype, -EDGE[dtype], "one")
    store.RegisterAdapter(store_pb.RegisterAdapterRequest(name=name, source=str(directory)), timeout=60)
    inference.LoadAdapter(pb.LoadAdapterRequest(name=name, source=str(directory)), timeout=60)
    # Served: an answer, or the error for logits that turned non-finite; never a NaN served as OK.
    code, detail = _code(
        inference.Generate, pb.GenerateRequest(text=["Hi"], adapter=[name], sampling_params=BASE_PARAMS)
    )
    assert code == grpc.StatusCode.OK or (code == grpc.StatusCode.INTERNAL and "non-finite" in detail), detail
    inference.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=60)
    assert _base_tokens(inference) == inference.base
