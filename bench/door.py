"""The door suite: what the OpenAI-compatible door adds to the time to first token, against gRPC directly.

    PYTHONPATH=protos .venv/bin/python -m loraplex.bench.door [--requests 100] [--out DIR]
    (or against running servers: --target HOST:PORT --door HOST:PORT)

Without --target it starts `python -m loraplex.services.inference` on the embedded SmolLM2 (CPU unless
--device says otherwise) and `python -m loraplex.services.openai` over it. Then, one request at a time
and alternating the two paths so both see the same machine, it streams the same prompt with
`max_new_tokens` 1 through `GenerateStream` and through `POST /v1/completions` (stream: true)
and takes the time from sending the request to the first token (the first stream message /
the first `data:` event). Minimal clients on both sides (a sync gRPC stub; http.client), so
the difference is the door's own: HTTP parsing, JSON, the gRPC hop, SSE framing.
Prints a table and writes door.json to --out DIR (bench/results.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import time
import urllib.request

import grpc

from loraplex.bench.results import add_out_argument, write_json
from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc

PROMPT = "List 3 countries and their capitals."


def grpc_ttft(stub, adapter: str) -> float:
    request = pb.GenerateRequest(
        text=[PROMPT], adapter=[adapter], sampling_params=pb.SamplingParams(max_new_tokens=1, temperature=0)
    )
    t0 = time.perf_counter()
    stream = stub.GenerateStream(request, timeout=60)
    for msg in stream:
        if msg.token_ids:
            elapsed = time.perf_counter() - t0
            stream.cancel()
            return elapsed
    raise RuntimeError("no token came back")


def door_ttft(conn: http.client.HTTPConnection, model: str) -> float:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"door answered {resp.status}: {resp.read()[:300]!r}")
    elapsed = None
    while True:
        line = resp.readline()
        if not line:
            break
        if elapsed is None and line.startswith(b"data: {"):
            elapsed = time.perf_counter() - t0
    if elapsed is None:
        raise RuntimeError("no event came back")
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def start(device: str) -> tuple[list[ServerProcess], str, str]:
    from loraplex.services.inference.default_model import ensure_model

    model = ensure_model()
    inference = ServerProcess(
        "inference",
        "loraplex.services.inference",
        ["--model-path", str(model), "--port", "0", "--device", device, "--adapter-store", "none"],
        echo=False,
    )
    inference.wait_serving(300)
    door = ServerProcess(
        "openai", "loraplex.services.openai", ["--target", inference.address, "--port", "0"], echo=False
    )
    door.wait_bound(60)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://{door.address}/health", timeout=2).close()
            break
        except OSError:
            time.sleep(0.1)
    return [door, inference], inference.address, door.address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="per path, after --warmup")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--target", default=None, help="a running inference server (else one is started)")
    parser.add_argument("--door", default=None, help="a running door over --target, HOST:PORT")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--adapter", default="", help="an adapter to ask for ('' = the base model)")
    add_out_argument(parser)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    children: list[ServerProcess] = []
    if args.target is None:
        children, target, door = start(args.device)
    else:
        target, door = args.target, args.door
        if door is None:
            raise SystemExit("--target needs --door")
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with urllib.request.urlopen(f"http://{door}/v1/models", timeout=30) as resp:
                base = json.loads(resp.read())["data"][0]["id"]
            model = args.adapter or base
            host, port = door.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            direct, via_door = [], []
            for i in range(args.warmup + args.requests):
                g = grpc_ttft(stub, args.adapter)
                d = door_ttft(conn, model)
                if i >= args.warmup:
                    direct.append(g)
                    via_door.append(d)
            conn.close()
    finally:
        for child in children:
            child.stop()

    load_after = os.getloadavg()[0]
    rows = {"grpc": direct, "openai door": via_door}
    stats = {
        name: {
            "p50_ms": statistics.median(v) * 1e3,
            "p90_ms": percentile(v, 0.9) * 1e3,
            "mean_ms": statistics.fmean(v) * 1e3,
        }
        for name, v in rows.items()
    }
    paired = [d - g for g, d in zip(direct, via_door, strict=True)]
    overhead = {
        "p50_ms": stats["openai door"]["p50_ms"] - stats["grpc"]["p50_ms"],
        "paired_median_ms": statistics.median(paired) * 1e3,
    }
    print(f"TTFT, {args.requests} requests per path, max_new_tokens 1, prompt {PROMPT!r}, model {model}")
    print(f"{'path':14} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}")
    for name, s in stats.items():
        print(f"{name:14} {s['p50_ms']:8.2f} {s['p90_ms']:8.2f} {s['mean_ms']:8.2f}")
    print(f"load average {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} CPUs")
    print(
        f"door overhead: p50 {overhead['p50_ms']:+.2f} ms, median of paired differences "
        f"{overhead['paired_median_ms']:+.2f} ms"
    )
    write_json(
        args.out,
        "door",
        {
            "requests": args.requests,
            "model": model,
            "device": args.device,
            "prompt": PROMPT,
            "host": platform.node(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": [load_before, load_after],
            "stats": stats,
            "overhead": overhead,
            "grpc_s": direct,
            "door_s": via_door,
        },
    )


if __name__ == "__main__":
    main()
