"""Tokens from the environment guard the right methods and never reach the logs.

One inference server on the tiny Llama, tokens given as LORAPLEX_API_TOKEN /
LORAPLEX_ADMIN_TOKEN (so they are not in the command line either), logging at debug level.
"""

from __future__ import annotations

import grpc
import pytest

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S

API = "api-7f3c9e2b1d"
ADMIN = "admin-5a8e4f0c6b"


@pytest.fixture(scope="module")
def server(tiny_llama_path, adapter_factory):
    adapter = adapter_factory(tiny_llama_path, "auth-adapter", r=4)
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        [
            "--model-path",
            str(tiny_llama_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "1024",
            "--max-lora-rank",
            "8",
            "--log-level",
            "debug",
            "--allowed-local-dirs",
            str(adapter.parent),
        ],
        env={"LORAPLEX_API_TOKEN": API, "LORAPLEX_ADMIN_TOKEN": ADMIN},
        echo=False,
    )
    try:
        proc.wait_serving(STARTUP_S)
        with grpc.insecure_channel(proc.address) as channel:
            yield proc, pb_grpc.InferenceStub(channel), adapter
    finally:
        assert proc.stop() == 0


def _code(fn, request, token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    try:
        fn(request, timeout=30, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def test_env_tokens_guard_methods_and_are_never_logged(server):
    proc, stub, adapter = server
    gen = pb.GenerateRequest(text=["Hi"], sampling_params=pb.SamplingParams(max_new_tokens=2))
    load = pb.LoadAdapterRequest(name="guarded", source=str(adapter))
    assert _code(stub.Generate, gen, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(stub.Generate, gen, API[:-1]) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(stub.Generate, gen, API + "x") == grpc.StatusCode.PERMISSION_DENIED
    assert _code(stub.Generate, gen, API) == grpc.StatusCode.OK
    assert (
        _code(stub.LoadAdapter, load, API) == grpc.StatusCode.PERMISSION_DENIED
    )  # the API token is not admin
    assert _code(stub.LoadAdapter, load, ADMIN) == grpc.StatusCode.OK
    assert _code(stub.UnloadAdapter, pb.UnloadAdapterRequest(name="guarded"), ADMIN) == grpc.StatusCode.OK
    log = proc.output()
    assert "tokens required" in log
    for secret in (API, ADMIN, API[:-1]):
        assert secret not in log, "a token reached the server log"
    assert API not in " ".join(proc.proc.args) and ADMIN not in " ".join(proc.proc.args)
