"""Mixed-step profile: steps that carry running decodes plus a prefill chunk, with and
without adapters. Per configuration: host time of `ModelRunner.forward` (launching, no sync: the
metadata prep before the model and the model's launches), GPU time (CUDA events), the step's wall
time, kernel launches per step and where the host time goes (torch.profiler), and the Triton
compilations the timed steps caused (0 after warm-up). The chunk-size sweep (step time against
prefill chunk size at a fixed decode batch) is what `--chunked-prefill-size` /
`--decode-prefill-budget` are picked from: the extra time a chunk adds to the step every running
decode waits for.

    PYTHONPATH=protos python3 -m loraplex.bench.mixed_step                      # H200, Llama-3.1-8B shape
    PYTHONPATH=protos python3 -m loraplex.bench.mixed_step --tiny --device cpu  # smoke check (torch LoRA)

Before timing it checks, on the device, that a mixed step's logits equal the same sequences run
as separate steps (decodes alone, the chunk alone) to the dtype's tolerance, and that greedy
tokens match. Prints tables; writes mixed_step.json to --out DIR (bench/results.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import torch

from loraplex.bench.mixed_graph_check import blocks_needed, run_all
from loraplex.bench.random_runner import TINY, build_runner
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.kernels.compile_watch import compile_counter
from loraplex.kernels.settings import kernel_settings
from loraplex.services.inference.engine.scheduler import SeqChunk
from loraplex.services.inference.engine.warmup import warm_up

log = logging.getLogger("loraplex.bench.mixed_step")
PAGE = 16
VOCAB = [1000]  # token ids are drawn below this (set to the model's vocabulary)


class Layout:
    """KV blocks for the benchmark's sequences: decode i owns blocks [i*per, (i+1)*per), the chunk
    the last."""

    def __init__(self, context: int, max_seqs: int):
        self.per = -(-context // PAGE) + 1
        self.max_seqs = max_seqs

    def table(self, seq: int) -> list[int]:
        return list(range(seq * self.per, (seq + 1) * self.per))

    @property
    def num_blocks(self) -> int:
        return (self.max_seqs + 1) * self.per


def make_step(
    layout: Layout, decodes: int, chunk: int, distinct: int, decode_ctx: int, chunk_start: int
) -> list[SeqChunk]:
    """`decodes` decode tokens at position `decode_ctx` then one prefill chunk of `chunk` tokens at
    `chunk_start`; adapters round-robin over `distinct` slots (0: none)."""

    def slot(i: int) -> int:
        return i % distinct if distinct else -1

    steps = [
        SeqChunk([(7 * i) % VOCAB[0]], decode_ctx, layout.table(i), slot(i), True) for i in range(decodes)
    ]
    if chunk:
        steps.append(
            SeqChunk(
                [(3 * j) % VOCAB[0] for j in range(chunk)],
                chunk_start,
                layout.table(layout.max_seqs),
                slot(decodes),
                True,
            )
        )
    return steps


def fill_contexts(runner, layout: Layout, decodes: int, ctx: int, distinct: int) -> None:
    """Prefill every decode sequence's first `ctx` tokens so the decodes attend over real KV."""
    for i in range(decodes):
        ids = [(11 * i + j) % VOCAB[0] for j in range(ctx)]
        runner.forward([SeqChunk(ids, 0, layout.table(i), i % distinct if distinct else -1, True)])


def time_step(runner, chunks: list[SeqChunk], repeats: int) -> dict:
    cuda = runner.device.type == "cuda"
    model = runner.model
    marks: dict[str, float] = {}
    inner = model.forward

    def timed_forward(*args, **kwargs):  # instrumentation: when the model's launches begin
        marks["model_start"] = time.perf_counter()
        return inner(*args, **kwargs)

    model.forward = timed_forward
    pieces = runner.mixed_graphs
    if pieces is not None:
        inner_run = pieces.run

        def timed_run(*args, **kwargs):  # the piecewise path: its uploads and replays begin here
            marks["model_start"] = time.perf_counter()
            return inner_run(*args, **kwargs)

        pieces.run = timed_run
    host, prep, gpu, wall = [], [], [], []
    try:
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            marks.clear()
            runner.forward(chunks)
            t1 = time.perf_counter()
            if cuda:
                e1.record()
                torch.cuda.synchronize()
                gpu.append(e0.elapsed_time(e1))
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            prep.append((marks.get("model_start", t0) - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    finally:
        del model.forward
        if pieces is not None:
            del pieces.run
    med = statistics.median
    return {
        "host_ms": med(host),
        "prep_ms": med(prep),
        "gpu_ms": med(gpu) if gpu else None,
        "step_ms": med(wall),
    }


def profile_step(runner, chunks: list[SeqChunk], repeats: int = 2) -> dict:
    """Kernel launches per step and the host-side entries that take the most self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(repeats):
            runner.forward(chunks)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    launch_names = (
        "cudaLaunchKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchKernelExC",
        "cudaGraphLaunch",
    )
    launches = sum(e.count for e in events if e.key in launch_names) / repeats
    kernels = sum(e.count for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")) / repeats
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "launches_per_step": launches,
        "gpu_kernels_per_step": kernels,
        "host_top": [
            (e.key, round(e.self_cpu_time_total / repeats / 1e3, 3), e.count // repeats) for e in top
        ],
    }


def check_mixed_equals_separate(runner, layout: Layout, distinct: int, dtype: torch.dtype) -> dict:
    """A mixed step's logits against the same work as separate steps (decodes, then the chunk)."""
    decodes, chunk, ctx = 8, 96, 64
    fill_contexts(runner, layout, decodes, ctx, distinct)
    mixed = make_step(layout, decodes, chunk, distinct, ctx, 0)
    got = runner.forward(mixed).float().clone()
    want = torch.cat([runner.forward(mixed[:decodes]).float(), runner.forward(mixed[decodes:]).float()])
    err = ((got - want).norm() / want.norm()).item()
    same = bool((got.argmax(-1) == want.argmax(-1)).all())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return {"distinct": distinct, "rel_err": err, "greedy_equal": same, "ok": err < tol and same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--decodes", default="1,16,64", help="decode batch sizes")
    p.add_argument("--chunks", default="0,64,256,512,1024,1536", help="prefill chunk sizes (0: decode only)")
    p.add_argument("--adapters", default="0,8,64", help="distinct adapters in the step (0: base model)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="decode sequences' context length")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--no-graphs", action="store_true", help="capture no CUDA graphs (decode or mixed)")
    p.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        default=2048,
        help="largest bucket of the piecewise mixed-step graphs (0: none)",
    )
    p.add_argument(
        "--modes",
        default="pieces,eager",
        help="time mixed steps through the piecewise graphs (pieces) and/or eagerly (eager)",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="time even when a check fails (the failure stays in the JSON and the output)",
    )
    add_out_argument(p)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(a.device)
    dtype = (
        getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    decodes = [int(x) for x in a.decodes.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    adapters = [int(x) for x in a.adapters.split(",")]
    slots = max(adapters)
    max_seqs = max(decodes) + 1
    max_tokens = max(decodes) + max(chunks)
    context = max(a.context + 1, max(chunks) + 1)
    layout = Layout(context + 16, max_seqs)
    # The graph check's requests reach positions cap + 96 and 3 * 128 + 12, in blocks of their own.
    runner_context = max(context + 16, a.mixed_graph_max_tokens + 128, 448)
    num_blocks = max(layout.num_blocks, blocks_needed(a.mixed_graph_max_tokens, max(adapters)))
    compile_counter.install()
    backend = "triton" if device.type == "cuda" or kernel_settings().triton_interpret else "torch"
    start = time.perf_counter()
    runner = build_runner(
        TINY if a.tiny else LLAMA_8B,
        dtype=dtype,
        device=device,
        slots=slots,
        rank=a.rank,
        max_num_tokens=max(max_tokens, 2048),
        max_num_seqs=max_seqs,
        context_length=runner_context,
        page_size=PAGE,
        num_blocks=num_blocks,
        lora_backend=backend,
    )
    VOCAB[0] = runner.config.vocab_size
    log.info(
        "runner built in %.1f s (LoRA backend %s, %d slots)", time.perf_counter() - start, backend, slots
    )
    graphs = device.type == "cuda" and not a.no_graphs
    if graphs:
        runner.capture_cuda_graphs(max(decodes))
    if a.mixed_graph_max_tokens > 0:  # on the CPU the pieces run eagerly (checks the path, times nothing)
        runner.capture_mixed_graphs(a.mixed_graph_max_tokens, use_graphs=graphs)
    if device.type == "cuda":
        # Both paths are timed here (the engine serves steps under the cap through the pieces only),
        # so warm the eager one too.
        pieces, runner.mixed_graphs = runner.mixed_graphs, None
        warm_up(
            runner, max_num_tokens=max(max_tokens, 2048), max_num_seqs=max_seqs, context_length=runner_context
        )
        runner.mixed_graphs = pieces
        warm_up(
            runner, max_num_tokens=max(max_tokens, 2048), max_num_seqs=max_seqs, context_length=runner_context
        )
    compile_counter.mark_serving()
    # Non-zero on the GPU shows Triton's compile hook fires (so the zero after start-up means something).
    hook = "installed" if compile_counter.installed else "missing"
    print(f"Triton compilations during start-up (hook {hook}): {compile_counter.total}", flush=True)
    mixed = runner.mixed_graphs

    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": "tiny" if a.tiny else "llama-3.1-8b",
        "dtype": str(dtype),
        "rank": a.rank,
        "context": a.context,
        "checks": [],
        "rows": [],
    }
    if mixed is not None:
        results["mixed_graphs"] = {
            "buckets": mixed.buckets,
            "tiers": list(mixed.tiers()),
            "graphs": sum(map(len, mixed.graphs.values())),
            "capture_s": mixed.capture_seconds,
            "capture_mib": mixed.capture_bytes / 2**20,
            "buffer_mib": mixed.buffer_bytes / 2**20,
        }
        print(f"mixed graphs: {results['mixed_graphs']}", flush=True)
        graph_check = run_all(runner, 0, slots)
        results["graph_check"] = graph_check
        lock = graph_check["lockstep"]
        print(
            f"check pieces == eager (lockstep, {len(lock['cases'])} steps): "
            f"worst rel_err {lock['worst_rel_err']:.2e}, argmax {lock['argmax_agree']}/{lock['rows']}: "
            f"{'ok' if lock['ok'] else 'FAILED'}",
            flush=True,
        )
        for g in graph_check["greedy"]:
            print(
                f"check greedy pieces on/off, {g['requests']} requests, {g['adapters']} adapters: "
                f"{'identical' if g['identical'] else 'diverged ' + json.dumps(g['diverged'])}: "
                f"{'ok' if g['ok'] else 'FAILED'}",
                flush=True,
            )
    saved, runner.mixed_graphs = runner.mixed_graphs, None
    for distinct in sorted({min(d, 8) for d in adapters}):
        check = check_mixed_equals_separate(runner, layout, distinct, dtype)
        results["checks"].append(check)
        print(
            f"check mixed == separate steps (eager), {distinct} adapters: rel_err {check['rel_err']:.2e}, "
            f"greedy equal {check['greedy_equal']}: {'ok' if check['ok'] else 'FAILED'}",
            flush=True,
        )
    runner.mixed_graphs = saved
    checks_ok = all(c["ok"] for c in results["checks"]) and results.get("graph_check", {"ok": True})["ok"]
    results["checks_ok"] = checks_ok
    if not checks_ok and not a.keep_going:
        print("correctness check failed: not timing", file=sys.stderr)
        write_json(a.out, "mixed_step", results)
        return 1

    compiles_before = compile_counter.after_start
    modes = [m for m in a.modes.split(",") if m == "eager" or (m == "pieces" and saved is not None)]
    for distinct in adapters:
        fill_contexts(runner, layout, max(decodes), a.context, distinct)
        for nd in decodes:
            for chunk in chunks:
                if distinct > nd + (1 if chunk else 0):
                    continue
                step = make_step(layout, nd, chunk, distinct, a.context, 0)
                for mode in modes if chunk else modes[:1]:
                    runner.mixed_graphs = saved if mode == "pieces" else None
                    row = {
                        "mode": mode,
                        "decodes": nd,
                        "chunk": chunk,
                        "adapters": distinct,
                        "tokens": nd + chunk,
                        **time_step(runner, step, a.repeats),
                        **profile_step(runner, step),
                    }
                    results["rows"].append(row)
                    log.debug("%s", row)
    runner.mixed_graphs = saved
    results["compiles_while_timing"] = compile_counter.after_start - compiles_before
    results["compiles_at_startup"] = compile_counter.total - compile_counter.after_start
    results["compiles_after_startup"] = compile_counter.after_start  # the checks' steps included
    print_tables(results)
    write_json(a.out, "mixed_step", results)
    return 0


def print_tables(results: dict) -> None:
    rows = results["rows"]
    print(
        f"\nmixed steps on {results['device']} ({results['shape']}, {results['dtype']}, "
        f"rank {results['rank']}, decode context {results['context']}); Triton compiles after start-up: "
        f"{results['compiles_after_startup']} (while timing: {results['compiles_while_timing']})"
    )
    print(
        "| mode | decodes | chunk | adapters | host ms (prep) | GPU ms | step ms | launches | GPU kernels "
        "| top host entry |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.2f}"
        top = r["host_top"][0] if r["host_top"] else ("", 0, 0)
        mode = r["mode"] if r["chunk"] else "decode only"
        print(
            f"| {mode} | {r['decodes']} | {r['chunk']} | {r['adapters']} | {r['host_ms']:.2f} "
            f"({r['prep_ms']:.2f}) | {gpu} | {r['step_ms']:.2f} | {r['launches_per_step']:.0f} "
            f"| {r['gpu_kernels_per_step']:.0f} | {top[0]} {top[1]} ms x{top[2]} |"
        )
    # Step time against chunk size at the largest decode batch: what each chunk costs every running decode.
    nd = max(r["decodes"] for r in rows)
    print(f"\nstep ms vs prefill chunk at {nd} decodes (+ms over the decode-only step)")
    print("| mode | adapters | " + " | ".join(str(c) for c in sorted({r["chunk"] for r in rows})) + " |")
    print("| --- | ---: |" + " ---: |" * len({r["chunk"] for r in rows}))
    for mode in sorted({r["mode"] for r in rows if r["chunk"]}):
        for distinct in sorted({r["adapters"] for r in rows}):
            sel = {
                r["chunk"]: r["step_ms"]
                for r in rows
                if r["decodes"] == nd and r["adapters"] == distinct and (r["mode"] == mode or not r["chunk"])
            }
            base = sel.get(0)
            cells = [
                f"{v:.2f}" + (f" (+{v - base:.2f})" if base is not None and c else "")
                for c, v in sorted(sel.items())
            ]
            print(f"| {mode} | {distinct} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
