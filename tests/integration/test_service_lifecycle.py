"""Server lifecycle over real gRPC: health, SIGTERM drain within the grace period, exit 0.

Uses the tiny random Llama so each server starts in seconds; every test starts its own
server because each one ends it.
"""

from __future__ import annotations

import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.clients.errors import from_rpc_error
from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S


def start(model, *extra: str) -> ServerProcess:
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        ["--model-path", str(model), "--port", "0", "--device", "cpu", "--max-total-tokens", "4096", *extra],
        echo=False,
    )
    proc.wait_serving(STARTUP_S)
    return proc


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


class Background(threading.Thread):
    """One long streaming call on its own thread; keeps every message and the final error."""

    def __init__(self, address: str, max_new_tokens: int) -> None:
        super().__init__(daemon=True)
        self.address, self.max_new_tokens = address, max_new_tokens
        self.messages: list[pb.GenerateStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self.started_streaming = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            params = pb.SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True)
            try:
                for msg in pb_grpc.InferenceStub(ch).GenerateStream(
                    pb.GenerateRequest(text=["Hello"], sampling_params=params)
                ):
                    self.messages.append(msg)
                    self.started_streaming.set()
            except grpc.RpcError as err:
                self.error = err
            self.started_streaming.set()


def test_sigterm_drains_running_requests_then_exits_0(tiny_llama_path):
    server = start(tiny_llama_path, "--grace-period", "60")
    try:
        assert health(server.address) == health_pb2.HealthCheckResponse.SERVING
        assert server.output().index("listening on") < server.output().index("SERVING")
        call = Background(server.address, 600)
        call.start()
        assert call.started_streaming.wait(30)
        server.proc.terminate()
        time.sleep(0.3)
        assert call.is_alive(), "the request finished before the drain could be observed; make it longer"
        assert health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(text=["x"]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        call.join(60)
        assert call.error is None
        assert call.messages[-1].finish_reason == "length" and call.messages[-1].completion_tokens == 600
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_grace_period_bounds_the_drain(tiny_llama_path):
    server = start(tiny_llama_path, "--grace-period", "1")
    try:
        call = Background(server.address, 3000)
        call.start()
        assert call.started_streaming.wait(30)
        t0 = time.monotonic()
        server.proc.terminate()
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
        call.join(10)
        assert call.error is not None and call.messages[-1].finish_reason == ""
    finally:
        server.stop()


def test_store_down_is_unavailable_with_retry_and_base_still_serves(tiny_llama_path):
    server = start(tiny_llama_path, "--adapter-store", "127.0.0.1:1")  # nothing listens on port 1
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(pb.GenerateRequest(text=["a"], adapter=["somewhere"]), timeout=30)
            typed = from_rpc_error(err.value)
            assert (
                typed.code == grpc.StatusCode.UNAVAILABLE
                and typed.retry_after_s
                and typed.resource == "somewhere"
            )
            assert "adapter store" in typed.message
            out = stub.Generate(
                pb.GenerateRequest(text=["a"], sampling_params=pb.SamplingParams(max_new_tokens=3))
            )
            assert out.completions[0].completion_tokens >= 1
            assert list(stub.ListAdapters(pb.ListAdaptersRequest()).adapters) == []
    finally:
        server.stop()


def test_full_queue_is_resource_exhausted_with_retry(tiny_llama_path):
    server = start(tiny_llama_path, "--max-queued-requests", "2")
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(pb.GenerateRequest(text=["a", "b", "c"]), timeout=30)
            typed = from_rpc_error(err.value)
            assert typed.code == grpc.StatusCode.RESOURCE_EXHAUSTED and typed.retry_after_s
            assert "--max-queued-requests" in typed.message
            ok = stub.Generate(
                pb.GenerateRequest(text=["a", "b"], sampling_params=pb.SamplingParams(max_new_tokens=2))
            )
            assert len(ok.completions) == 2
    finally:
        server.stop()


def test_tls_and_tokens(tiny_llama_path, tmp_path):
    from loraplex.clients import Client
    from loraplex.clients.errors import LoraplexError

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = ServerProcess(
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
            "2048",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--api-token",
            "user-secret",
            "--admin-token",
            "admin-secret",
        ],
        echo=False,
    )
    try:
        server.wait_serving(STARTUP_S, tls_ca=str(cert))  # health needs no token
        assert "(TLS), tokens required" in server.output()
        with Client(server.address, tls_ca=str(cert), timeout=30) as anonymous:
            with pytest.raises(LoraplexError) as err:
                anonymous.generate("a", max_new_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(LoraplexError) as err:
                list(anonymous.generate_stream("a", max_new_tokens=2))
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(server.address, tls_ca=str(cert), timeout=30, token="user-secret") as user:
            assert user.generate("a", max_new_tokens=2)[0].completion_tokens >= 1
            with pytest.raises(LoraplexError) as err:
                user.unload_adapter("x")
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        with Client(server.address, tls_ca=str(cert), timeout=30, token="admin-secret") as admin:
            with pytest.raises(LoraplexError) as err:
                admin.unload_adapter("x")
            assert err.value.code == grpc.StatusCode.NOT_FOUND  # authorised; the adapter just is not there
            assert admin.generate("a", max_new_tokens=2)[0].completion_tokens >= 1
        with grpc.insecure_channel(server.address) as plain, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        server.stop()
