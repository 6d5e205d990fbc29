"""`loraplex up`: store + inference as one process tree, health SERVING, clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LORAPLEX = Path(sys.executable).parent / "loraplex"


def launch_up(cache_dir: Path, model: Path, *flags: str, max_total_tokens: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(LORAPLEX),
            "up",
            *flags,
            "--port",
            "0",
            "--store-port",
            "0",
            "--openai-port",
            "0",  # 8000 may be taken on a shared machine
            "--cache-dir",
            str(cache_dir),
            "--model-path",
            str(model),
            "--",
            "--max-total-tokens",
            max_total_tokens,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama_path):
    """Both tests' stacks, launched together so they load side by side (each test waits for its
    own banner, drives it and stops it); (process, cache dir) by name."""
    dirs = {name: tmp_path_factory.mktemp(f"up-{name}") for name in ("one", "replicas")}
    procs = {
        "one": launch_up(dirs["one"], tiny_llama_path, max_total_tokens="2048"),
        "replicas": launch_up(dirs["replicas"], tiny_llama_path, "--replicas", "2", max_total_tokens="1024"),
    }
    yield {name: (procs[name], dirs[name]) for name in procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_starts_the_stack_and_stops_it(stacks):
    proc, _ = stacks["one"]
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        inference = re.search(r"inference\s+(\S+:\d+)", text).group(1)
        store = re.search(r"store\s+(\S+:\d+)", text).group(1)
        child_pids = [int(p) for p in re.findall(r"embedded Redis \(pid (\d+)\)", text)]
        # the printed CLI line works as printed (with our venv's loraplex)
        line = next(x for x in lines if "loraplex --target" in x).strip()
        argv = shlex.split(line)
        argv[0] = str(LORAPLEX)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        grpcurl_line = next(x for x in lines if "grpcurl -plaintext" in x)
        assert inference in grpcurl_line
        # ... and so does the printed grpcurl line (reflection, JSON with a chat-formatted prompt)
        argv = shlex.split(grpcurl_line.strip())
        argv[0] = str(LORAPLEX.parent / "grpcurl")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        [completion] = json.loads(out.stdout)["completions"]
        assert int(completion["prompt_tokens"]) == 17, completion  # ChatML special tokens parsed as such
        assert completion["finish_reason"] in ("stop", "length")
        # ... and the OpenAI door's curl line
        curl_line = next(x for x in lines if "curl -s http://" in x)
        out = subprocess.run(shlex.split(curl_line.strip()), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] > 0, answer
        health = subprocess.run([str(LORAPLEX), "--target", store, "health"], capture_output=True, text=True)
        assert health.stdout.strip() == "SERVING"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "inference stopped (exit 0)" in rest and "store stopped (exit 0)" in rest
        assert "openai stopped (exit 0)" in rest, rest[-3000:]
        for pid in child_pids:
            assert (
                not Path(f"/proc/{pid}").exists()
                or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_with_replicas_puts_the_router_in_front(stacks):
    import grpc

    from loraplex.v1 import inference_pb2 as pb
    from loraplex.v1 import inference_pb2_grpc as pb_grpc

    proc, tmp_path = stacks["replicas"]
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        router = re.search(r"inference\s+(\S+:\d+)\s+\(loraplex.v1.Inference\)\s+\(nginx router", text).group(
            1
        )
        assert len(re.findall(r"replica\s+\S+:\d+", text)) == 2
        seen = set()
        with grpc.insecure_channel(router) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for _ in range(4):  # base calls go round robin; each names its replica
                request = pb.GenerateRequest(text=["Hi"], sampling_params=pb.SamplingParams(max_new_tokens=2))
                _, call = stub.Generate.with_call(request, timeout=60)
                seen.add(dict(call.trailing_metadata())["x-loraplex-replica"])
        assert seen == {"replica-0", "replica-1"}
        # One replica dies: the stack stays up, the other serves, and the dead one comes back.
        victim = replica_pid("replica-0", str(tmp_path))
        os.kill(victim, signal.SIGKILL)
        with grpc.insecure_channel(router) as channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(text=["Hi"], sampling_params=pb.SamplingParams(max_new_tokens=2))
            seen = set()
            deadline = time.monotonic() + 180
            while "replica-0" not in seen:
                assert time.monotonic() < deadline and proc.poll() is None, "replica-0 did not come back"
                try:
                    _, call = stub.Generate.with_call(request, timeout=60)
                    seen.add(dict(call.trailing_metadata())["x-loraplex-replica"])
                except grpc.RpcError as err:  # the call the dying replica had, or nginx's 2 s mark
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                time.sleep(0.5)
        assert "replica-1" in seen and replica_pid("replica-0", str(tmp_path)) != victim
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "router stopped (exit 0)" in rest and "replica-1 stopped (exit 0)" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def replica_pid(name: str, marker: str) -> int:
    """The pid of the inference replica `name` that `loraplex up` started under `marker` (its cache dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"loraplex.services.inference" in argv
            and name.encode() in argv
            and any(marker.encode() in a for a in argv)
        ):
            return int(entry.name)
    raise AssertionError(f"no running {name}")
