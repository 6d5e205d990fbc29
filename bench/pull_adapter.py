"""Adapter store benchmark: PullAdapter of a ~100 MB adapter over loopback gRPC.

    .venv/bin/python -m loraplex.bench.pull_adapter [--mb 100] [--reps 5] [--out DIR]

Writes a random LoRA adapter in PEFT layout (fp32, Llama-shaped square projections), starts
`python -m loraplex.adapter_store --port 0` (embedded Redis) as a subprocess, registers the adapter
(timing fetch + validation + hashing), then pulls it `--reps` times: the stream alone, the
stream plus the client's sha256 check, and the shared-cache answer (a path, no data).
Prints a table and writes JSON to --out DIR (bench/results.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from loraplex.bench.results import add_out_argument, write_json
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.support.store_helpers import WEIGHTS, start_store, write_random_adapter

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


def pull_once(stub: pb_grpc.AdapterStoreStub, name: str, verify: bool) -> tuple[float, int, str]:
    h = hashlib.sha256() if verify else None
    size = 0
    header = None
    t0 = time.perf_counter()
    for chunk in stub.PullAdapter(pb.PullAdapterRequest(name=name), timeout=600):
        if chunk.WhichOneof("payload") == "header":
            header = chunk.header
            continue
        size += len(chunk.data)
        if h is not None:
            h.update(chunk.data)
    elapsed = time.perf_counter() - t0
    if h is not None and "sha256:" + h.hexdigest() != header.record.digest:
        raise SystemExit("digest mismatch")
    return elapsed, size, header.record.digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="approximate adapter size in MB")
    parser.add_argument("--reps", type=int, default=5)
    add_out_argument(parser)
    args = parser.parse_args()

    hidden, r = 4096, 16
    per_layer = len(MODULES) * 2 * r * hidden * 4
    layers = max(1, round(args.mb * 1e6 / per_layer))
    with tempfile.TemporaryDirectory(prefix="lpx-bench-") as tmp:
        src = write_random_adapter(Path(tmp) / "adapter", hidden=hidden, layers=layers, r=r, modules=MODULES)
        size = (src / WEIGHTS).stat().st_size
        with (
            start_store(Path(tmp) / "cache", "--max-adapter-bytes", str(4 * size)) as proc,
            grpc.insecure_channel(proc.address, options=[("grpc.max_receive_message_length", 8 << 20)]) as ch,
        ):
            stub = pb_grpc.AdapterStoreStub(ch)
            t0 = time.perf_counter()
            stub.RegisterAdapter(pb.RegisterAdapterRequest(name="bench", source=str(src)), timeout=600)
            register_s = time.perf_counter() - t0
            pull_once(stub, "bench", verify=False)  # warm the page cache and the channel
            stream = [pull_once(stub, "bench", verify=False)[0] for _ in range(args.reps)]
            verified = [pull_once(stub, "bench", verify=True)[0] for _ in range(args.reps)]
            shared = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                list(stub.PullAdapter(pb.PullAdapterRequest(name="bench", shared_cache=True), timeout=60))
                shared.append(time.perf_counter() - t0)

    mb = size / 1e6
    rows = [
        ("register (copy+validate+hash)", register_s, mb / register_s),
        ("PullAdapter stream", statistics.median(stream), mb / statistics.median(stream)),
        ("PullAdapter stream + sha256", statistics.median(verified), mb / statistics.median(verified)),
        ("PullAdapter shared_cache (path)", statistics.median(shared), float("nan")),
    ]
    print(
        f"adapter: {mb:.1f} MB fp32, {layers} layers x {len(MODULES)} modules, r={r}, hidden={hidden}; "
        f"{args.reps} reps, median; host {platform.node()} ({os.cpu_count()} cpus)"
    )
    print(f"{'what':34s} {'seconds':>9s} {'MB/s':>9s}")
    for what, seconds, rate in rows:
        print(f"{what:34s} {seconds:9.3f} {rate:9.1f}")
    write_json(
        args.out,
        "pull_adapter",
        {
            "bench": "pull_adapter",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "size_bytes": size,
            "reps": args.reps,
            "cpus": os.cpu_count(),
            "register_s": register_s,
            "stream_s": stream,
            "stream_verified_s": verified,
            "shared_cache_s": shared,
            "stream_mb_s": mb / statistics.median(stream),
            "stream_verified_mb_s": mb / statistics.median(verified),
        },
    )


if __name__ == "__main__":
    main()
