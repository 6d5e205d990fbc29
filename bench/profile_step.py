"""Where a decode step's GPU time goes: one replay of the batch-64 decode graph (base, 8 and 64
adapters) under the torch profiler, kernel by kernel and stream by stream.

    PYTHONPATH=protos python3 -m loraplex.bench.profile_step [--adapters 64] [--out DIR]

Same model and engine as bench/serving.py (Llama-3.1-8B shape, random weights, rank-16 adapters on
all seven projections). Per graph it prints: the replay's span; each stream's busy time and the
main stream's idle time (waiting for the LoRA side stream or for launches); time per kernel kind;
and one middle layer's kernels in start order (stream, start, duration). Also times the decode
linears' matmuls through cuBLAS and cuBLASLt. Writes the chrome traces (trace_N.json) and
profile_step.json to --out DIR (bench/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from loraplex.bench import serving_setup as setup
from loraplex.bench.graph_timing import replay_ms
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving import build
from loraplex.bench.serving_engine import abort_all, add_batch, run_until_decoding

KINDS = (
    ("gemm", ("gemm", "cutlass", "sm90", "nvjet", "gemv")),
    ("shrink", ("_shrink",)),
    ("expand", ("_expand",)),
    ("attention", ("_decode_split", "_decode_merge", "attn")),
    ("norm", ("rms",)),
    ("rotary", ("rotary",)),
    ("silu", ("silu",)),
    ("kv store", ("kv_store", "store_kv")),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def trace_replay(graph: torch.cuda.CUDAGraph, path: Path) -> list[dict]:
    """Kernel events (name, stream, ts, dur in us) of one replay (the third of three)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # Replays are separated by a sync: split at the two largest gaps.
    gaps = sorted(
        range(1, len(kernels)), key=lambda i: kernels[i]["ts"] - kernels[i - 1]["ts"] - kernels[i - 1]["dur"]
    )
    cut = sorted(gaps[-2:])
    last = kernels[cut[1] :]
    return [dict(name=e["name"], stream=e["args"].get("stream"), ts=e["ts"], dur=e["dur"]) for e in last]


def summarize(kernels: list[dict], layers: int) -> dict:
    t0 = kernels[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in kernels) - t0
    streams = defaultdict(float)
    by_kind = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        streams[e["stream"]] += e["dur"]
        by_kind[kind(e["name"])][0] += 1
        by_kind[kind(e["name"])][1] += e["dur"]
    main = max(
        streams, key=lambda s: sum(1 for e in kernels if e["stream"] == s and kind(e["name"]) == "gemm")
    )
    attn = [i for i, e in enumerate(kernels) if "_decode_split" in e["name"]]  # one per layer
    mid = min(layers // 2, len(attn) - 2)
    lo, hi = attn[mid], attn[mid + 1]
    layer = [
        dict(
            stream=e["stream"],
            kind=kind(e["name"]),
            name=e["name"][:60],
            start_us=round(e["ts"] - kernels[lo]["ts"], 1),
            dur_us=round(e["dur"], 1),
        )
        for e in kernels[lo:hi]
    ]
    return dict(
        span_us=span,
        main_stream=main,
        busy_us=dict(streams),
        main_idle_us=span - streams[main],
        kinds={k: dict(count=c, us=round(t, 1)) for k, (c, t) in sorted(by_kind.items())},
        layer=layer,
    )


def print_summary(label: str, s: dict) -> None:
    print(
        f"\n== {label}: replay span {s['span_us']:.0f} us; main stream {s['main_stream']} idle "
        f"{s['main_idle_us']:.0f} us; busy per stream { ({k: round(v) for k, v in s['busy_us'].items()}) }"
    )
    print(
        "   per kind (count, us): "
        + ", ".join(f"{k} {v['count']}/{v['us']:.0f}" for k, v in s["kinds"].items())
    )
    print(f"   one layer ({len(s['layer'])} kernels): stream kind start dur name")
    for e in s["layer"]:
        print(f"     {e['stream']!s:>4} {e['kind']:<9}{e['start_us']:8.1f}{e['dur_us']:7.1f}  {e['name']}")


def matmul_libs() -> dict[str, dict[str, float]]:
    """us per decode-shaped matmul (64 tokens) of the model's linears, cuBLAS vs cuBLASLt."""
    import triton

    shapes = dict(
        qkv=(6144, 4096), o=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336), lm_head=(128256, 4096)
    )
    out: dict[str, dict[str, float]] = {}
    lib = torch.backends.cuda.preferred_blas_library()
    for name, (n, k) in shapes.items():
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for b in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(b)
            ms = triton.testing.do_bench(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), warmup=20, rep=200, return_mode="median"
            )
            out.setdefault(name, {})[b] = ms * 1e3
    torch.backends.cuda.preferred_blas_library(lib)
    return out


def bench_engine(adapters: int, work: Path):
    """The bench/serving.py engine at batch 64 with `adapters` rank-16 adapters loaded (a00, a01, ...)
    and 64 random 1024-token prompts: (async engine, adapter names, prompts)."""
    shape = setup.LLAMA_8B
    model_dir = setup.write_model_dir(work / "model", shape, device="cuda")
    adapter_dirs = setup.write_adapters(work / "adapters", model_dir, adapters, shape, device="cuda")
    opts = argparse.Namespace(
        max_bs=64,
        context_length=2048,
        disable_cuda_graph=False,
        disable_overlap_schedule=False,
        mem_fraction=0.7,
        tp_size=1,
        lora_backend=None,
    )
    async_engine, _ = build(model_dir, opts, len(adapter_dirs))
    names = [f"a{i:02d}" for i in range(len(adapter_dirs))]
    for name, path in zip(names, adapter_dirs, strict=True):
        async_engine.lora_manager.load_adapter(name, str(path))
    rng = random.Random(0)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(1024)] for _ in range(64)]
    return async_engine, names, prompts


def start_batch(engine, prompts: list[list[int]], names: list[str], distinct: int) -> list[str]:
    """Batch 64 over `distinct` adapters, decoding: the graph's static inputs hold a real step of it."""
    adapters = [None] * 64 if distinct == 0 else [names[i % distinct] for i in range(64)]
    ids = add_batch(engine, prompts, adapters, max_new_tokens=1024)
    run_until_decoding(engine, ids)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    return ids


def bench_args(doc: str) -> argparse.Namespace:
    """--adapters, --work, --out for the scripts built on `bench_engine`; logging on."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--work", default="/tmp/loraplex-bench")
    add_out_argument(p)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return p.parse_args()


def main() -> int:
    opts = bench_args(__doc__)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    layers = setup.LLAMA_8B["num_hidden_layers"]
    async_engine, names, prompts = bench_engine(opts.adapters, Path(opts.work))
    engine = async_engine.engine
    graphs = engine.runner.cuda_graphs
    res: dict = dict(device=torch.cuda.get_device_name(), matmul_us=matmul_libs(), graphs={})
    print(
        "decode matmul us (64 tokens), cuBLAS / cuBLASLt:",
        {k: f"{v['cublas']:.1f}/{v['cublaslt']:.1f}" for k, v in res["matmul_us"].items()},
    )
    for distinct in (0, 8, min(64, len(names))):
        ids = start_batch(engine, prompts, names, distinct)
        key = graphs.key(64, distinct)
        label = f"batch 64, {distinct} adapters"
        replay = statistics.median(replay_ms(graphs.graphs[key], 20))
        s = summarize(trace_replay(graphs.graphs[key], out / f"trace_{distinct}.json"), layers)
        s["replay_ms"] = replay
        res["graphs"][label] = s
        print_summary(f"{label} (replay {replay:.3f} ms)", s)
        abort_all(engine, ids)
        for _ in range(2):
            engine.step()
    write_json(out, "profile_step", res)
    asyncio.run(async_engine.shutdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
