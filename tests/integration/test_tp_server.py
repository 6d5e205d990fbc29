"""`python -m loraplex.services.inference --tp-size 2`: the real server spawns its worker, serves a mixed
adapter batch equal to `--tp-size 1`, and takes its worker down with it on SIGTERM."""

from __future__ import annotations

import grpc
import psutil

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.test_tp import PROMPTS, outputs, tp_args
from tests.support.service_stack import STARTUP_S


def tp2_server(name: str, model_path) -> ServerProcess:
    """A small `--tp-size 2` CPU server (not started) for the worker-lifecycle tests."""
    return ServerProcess(
        name,
        "loraplex.services.inference",
        [
            "--model-path",
            str(model_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--tp-size",
            "2",
            "--max-total-tokens",
            "1024",
            "--context-length",
            "256",
            "--max-lora-rank",
            "4",
        ],
        echo=False,
    )


def test_server_tp2_generate_matches_tp1_and_stops_its_worker(tiny_llama_path, adapter_factory):
    adapters = {
        "qv": adapter_factory(tiny_llama_path, "qv", r=8, target_modules=["q_proj", "v_proj"], seed=7),
        "down": adapter_factory(
            tiny_llama_path, "down", r=4, target_modules=["down_proj", "gate_proj"], seed=8
        ),
    }
    names = ["", "qv", "down", "qv"]
    want = outputs(
        tp_args(tiny_llama_path, 1, adapters), list(zip(PROMPTS, [n or None for n in names], strict=True)), 6
    )
    server = ServerProcess(
        "inference-tp2",
        "loraplex.services.inference",
        [
            "--model-path",
            str(tiny_llama_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--tp-size",
            "2",
            "--max-total-tokens",
            "2048",
            "--context-length",
            "512",
            "--max-lora-rank",
            "16",
            "--lora-target-modules",
            "all",
            "--max-loras-per-batch",
            "4",
            "--grace-period",
            "2",
            "--lora-paths",
            *(f"{n}={p}" for n, p in adapters.items()),
        ],
        echo=False,
    )
    try:
        server.wait_serving(STARTUP_S)
        children = psutil.Process(server.proc.pid).children(recursive=True)
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1, [c.cmdline() for c in children]  # rank 1; rank 0 is the server
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).tp_size == 2
            params = pb.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            resp = stub.Generate(
                pb.GenerateRequest(text=PROMPTS, adapter=names, sampling_params=params), timeout=60
            )
        assert [list(c.token_ids) for c in resp.completions] == want
    finally:
        code = server.stop()
    assert code == 0, server.output()[-3000:]
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"worker processes left behind: {alive}"


def test_worker_exits_when_the_server_is_killed(tiny_llama_path):
    """SIGKILL gives rank 0 no chance to stop its worker: the worker sees its pipe close and exits."""
    server = tp2_server("inference-tp2-kill", tiny_llama_path)
    try:
        server.wait_serving(STARTUP_S)
        children = psutil.Process(server.proc.pid).children(recursive=True)
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1
        server.proc.kill()
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, "the worker outlived its server"
    finally:
        server.stop()


def test_dead_worker_takes_the_server_to_not_serving(tiny_llama_path):
    """A worker that dies: health reports NOT_SERVING with a log line naming it, and no RPC hangs."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = tp2_server("inference-tp2-dead", tiny_llama_path)
    try:
        server.wait_serving(STARTUP_S)
        children = psutil.Process(server.proc.pid).children(recursive=True)
        [worker] = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        worker.kill()
        with grpc.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 15
            status = None
            while time.monotonic() < deadline:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.2)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = pb_grpc.InferenceStub(ch)
            params = pb.SamplingParams(max_new_tokens=2)
            try:
                stub.Generate(pb.GenerateRequest(text=["hi"], sampling_params=params), timeout=20)
                raise AssertionError("Generate succeeded on a server whose worker is dead")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "engine unhealthy" in server.output()
    finally:
        server.stop()
