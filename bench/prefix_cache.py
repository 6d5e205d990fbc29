"""Prefix cache on vs off under an open-loop workload.

    PYTHONPATH=protos python3 -m loraplex.bench.prefix_cache --mode gpu [--requests 256]
        [--load 2.0 | --rate R]
    PYTHONPATH=protos python3 -m loraplex.bench.prefix_cache --mode cpu [--out DIR]

Two workloads over the same adapters and the same Poisson arrivals, each run with the prefix cache
on and off on one engine (`BlockManager.reset_prefix_cache` between runs, so nothing cached leaks
from one run into the next):
- shared: each adapter's requests start with that adapter's system prompt (`--system-tokens`,
  1,024 on GPU) followed by `--unique-tokens` (128) tokens of their own;
- unique: the same lengths, no prefix shared by any two requests (the cache cannot help; it
  must cost nothing).
`--repeats N` runs each (workload, setting) N times, alternating which setting goes first, and
reports medians. Requests name the adapters round robin and generate `--new-tokens` tokens (EOS
ignored). The engine is the server's (`build_llm_engine`), driven on this thread: each loop adds the requests
whose arrival time has passed, then runs one step. TTFT = first output token time - arrival;
output tokens/s = all output tokens / (last finish - first arrival), the span in which all
requests complete; CPU s = the process's CPU time over the run (on a shared CPU, where wall times
drift with other jobs, the steadier measure of the work done); sched us/step = host time in
`Scheduler.schedule` per step, from the engine's step timer (the prefix cache's lookups, the
hashing of prompt blocks and the registration of running requests' blocks run inside it).

The arrival rate: `--rate`, or `--load` (2.0) times the cache-off capacity, measured first as a
burst (`--burst` cold requests of the timed shape arriving at once, cache off, so steps mix
prefill chunks and decodes as under the real load): requests over the burst's span, which the
decode-only steps at its end make an underestimate. Offered above capacity, the
cache-off server is saturated, its span outlasts the arrivals, and output tokens/s is what it can
serve rather than the offered rate; a cache that raises capacity shows as more tokens/s. The
table prints the arrival span beside each run's span to check this.

GPU mode writes a Llama-3.1-8B-shaped random bf16 model and rank-16 adapters
(bench/serving_setup.py, under `--work`; reused when already there); CPU mode runs the embedded
SmolLM2-135M with small random adapters. Prints a table; writes prefix_cache.json to --out DIR
(bench/results.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from loraplex.bench import serving_setup as setup
from loraplex.bench.results import add_out_argument, write_json

log = logging.getLogger("loraplex.bench.prefix_cache")
SMOLLM2 = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
)
TINY = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=4096,
)
DEFAULTS = {  # mode -> option defaults
    "gpu": dict(requests=256, system_tokens=1024, unique_tokens=128, new_tokens=64, adapters=8, rank=16),
    "cpu": dict(requests=24, system_tokens=256, unique_tokens=32, new_tokens=8, adapters=4, rank=8),
}


def build(opts: argparse.Namespace):
    """The engine, its adapter names and the token id range prompts draw from."""
    from loraplex.services.inference.engine.build import build_llm_engine
    from loraplex.services.inference.server_args import ServerArgs

    work = Path(opts.work)
    if opts.mode == "gpu":  # --tiny: the same path with a small shape (checks the script on a CPU)
        shape = TINY if opts.tiny else setup.LLAMA_8B
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model_dir = work / "model"
        if not _written(model_dir, shape):  # writing 16 GB of random weights takes a while: reuse them
            setup.write_model_dir(model_dir, shape, device=dev)
        adapter_dirs = setup.write_adapters(
            work / "adapters", model_dir, opts.adapters, shape, rank=opts.rank, device=dev
        )
        extra = dict(device=dev, dtype="bfloat16", context_length=4096)
        vocab = (1000, shape["vocab_size"] - 1000) if opts.tiny else (1000, 100000)
    else:
        from loraplex.services.inference.default_model import ensure_model

        model_dir = ensure_model()
        adapter_dirs = setup.write_adapters(
            work / "adapters-smollm2", model_dir, opts.adapters, SMOLLM2, rank=opts.rank, device="cpu"
        )
        extra = dict(device="cpu", dtype="float32", context_length=2048, max_total_tokens=16384)
        vocab = (1000, 48000)
    names = [f"a{i}" for i in range(opts.adapters)]
    args = ServerArgs.from_fields(
        model_path=str(model_dir),
        lora_paths=tuple(f"{n}={d}" for n, d in zip(names, adapter_dirs, strict=True)),
        max_loras_per_batch=opts.adapters,
        max_lora_rank=opts.rank,
        lora_target_modules=("all",),
        max_running_requests=opts.max_running,
        cuda_graph_max_bs=min(opts.max_running, 256),
        **extra,
    )
    engine, _ = build_llm_engine(args.engine, args.lora)
    return engine, names, vocab


def _written(model_dir: Path, shape: dict) -> bool:
    """A model directory serving_setup finished (the tokenizer comes last) with this shape."""
    config = model_dir / "config.json"
    if not (config.is_file() and (model_dir / "tokenizer.json").is_file()):
        return False
    written = json.loads(config.read_text())
    return all(written.get(k) == v for k, v in shape.items())


def workloads(opts, names: list[str], vocab: tuple[int, int]) -> dict[str, list[tuple[list[int], str]]]:
    rng = random.Random(opts.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    systems = {name: draw(opts.system_tokens) for name in names}
    length = opts.system_tokens + opts.unique_tokens
    shared = [
        (systems[names[i % len(names)]] + draw(opts.unique_tokens), names[i % len(names)])
        for i in range(opts.requests)
    ]
    unique = [(draw(length), names[i % len(names)]) for i in range(opts.requests)]
    return {"shared": shared, "unique": unique}


def run_open_loop(engine, jobs, arrivals: list[float], new_tokens: int, tag: str) -> dict:
    from loraplex.services.inference.engine.types import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    n = len(jobs)
    first: list[float | None] = [None] * n
    finish: list[float | None] = [None] * n
    out_tokens = [0] * n
    steps = 0
    sched = dict(s=0.0, tokens=0)

    def timer(phase: str, started: float, result) -> None:  # the scheduler's (and prefix cache's) time
        if phase == "schedule":
            sched["s"] += time.perf_counter() - started
            sched["tokens"] += result.num_tokens

    engine.step_timer = timer
    cpu_start = time.process_time()
    start = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(f"{tag}-{nxt}", jobs[nxt][0], params, jobs[nxt][1])
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        outputs = engine.step()
        steps += 1
        t = time.perf_counter() - start
        for out in outputs:
            k = int(out.request_id.rsplit("-", 1)[1])
            if out.new_token_ids and first[k] is None:
                first[k] = t
            out_tokens[k] += len(out.new_token_ids)
            if out.finished:
                finish[k] = t
    engine.step_timer = None
    if engine.errors:
        raise RuntimeError(f"requests failed: {dict(list(engine.errors.items())[:3])}")
    ttft = sorted(f - a for f, a in zip(first, arrivals, strict=True))
    span = max(finish) - arrivals[0]
    stats = engine.stats()
    return dict(
        ttft_p50_ms=1e3 * statistics.median(ttft),
        ttft_p90_ms=1e3 * ttft[int(0.9 * (n - 1))],
        output_tok_s=sum(out_tokens) / span,
        span_s=span,
        last_first_token_s=max(first) - arrivals[0],
        steps=steps,
        cpu_s=time.process_time() - cpu_start,
        tokens_per_step=sched["tokens"] / steps,
        schedule_us_per_step=1e6 * sched["s"] / steps,
        hit_tokens=sum(stats.prefix_cache_hit_tokens.values()),
        prompt_tokens=sum(len(j[0]) for j in jobs),
        evictions=stats.prefix_cache_evictions,
        preemptions=engine.scheduler.num_preemptions,
    )


def closed_batch_s(engine, jobs, new_tokens: int) -> float:
    from loraplex.services.inference.engine.types import SamplingParams

    start = time.perf_counter()
    engine.generate(
        [j[0] for j in jobs], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), [j[1] for j in jobs]
    )
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["gpu", "cpu"], default="gpu" if torch.cuda.is_available() else "cpu")
    for key in DEFAULTS["gpu"]:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    p.add_argument(
        "--rate", type=float, default=None, help="requests/s (default: --load x cache-off capacity)"
    )
    p.add_argument(
        "--load", type=float, default=2.0, help="offered requests/s over the measured cache-off capacity"
    )
    p.add_argument(
        "--burst", type=int, default=None, help="requests of the capacity burst (default: min(requests, 96))"
    )
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each workload and setting (medians reported)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="gpu mode with a 2-layer random model (a quick check)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default on a CPU: 1)")
    p.add_argument("--work", default="/tmp/loraplex-bench-prefix")
    add_out_argument(p)
    opts = p.parse_args()
    for key, value in DEFAULTS[opts.mode].items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if opts.threads or not torch.cuda.is_available():
        torch.set_num_threads(opts.threads or 1)  # on a shared CPU, two threads fighting are ~10x slower
    t0 = time.perf_counter()
    engine, names, vocab = build(opts)
    setup_s = time.perf_counter() - t0
    loads = workloads(opts, names, vocab)
    blocks = engine.block_manager

    # Warm up, then measure the cache-off capacity under the real load: a burst of cold requests of
    # the timed shape, all arriving at once, cache off, its steps mixing prefill chunks and decodes.
    # Requests over the burst's whole span understate a saturated server's rate (the burst ends in
    # decode-only steps), hence an offered load of 2x it; requests admitted per second until the
    # last first token overstate it (later steps carry more decodes), so it is only logged.
    rng = random.Random(opts.seed + 1)
    burst = opts.burst or min(opts.requests, 96)
    cold = [
        (
            [rng.randrange(*vocab) for _ in range(opts.system_tokens + opts.unique_tokens)],
            names[i % len(names)],
        )
        for i in range(len(names) + burst)
    ]
    blocks.reset_prefix_cache(False)
    closed_batch_s(engine, cold[: len(names)], 2)
    probe = run_open_loop(engine, cold[len(names) :], [0.0] * burst, opts.new_tokens, "capacity")
    capacity = burst / probe["span_s"]
    rate = opts.rate or opts.load * capacity
    gaps = random.Random(opts.seed + 2)
    arrivals, t = [], 0.0
    for _ in range(opts.requests):
        arrivals.append(t)
        t += gaps.expovariate(rate)
    log.info(
        "cache-off capacity %.2f requests/s = %.0f output tok/s (%d-request burst; admitted %.2f/s until "
        "its last first token) -> %.2f requests/s offered",
        capacity,
        probe["output_tok_s"],
        burst,
        burst / probe["last_first_token_s"],
        rate,
    )
    # Short untimed open-loop runs of both workloads (on other tokens), cache on and off, so every
    # kind of step (short prefills after a hit, mixed prefill + decode) has run before timing.
    for workload in loads:
        for cache in (True, False):
            blocks.reset_prefix_cache(cache)
            warm = workloads(
                argparse.Namespace(**{**vars(opts), "requests": 2 * len(names), "seed": opts.seed + 3}),
                names,
                vocab,
            )[workload][: len(arrivals)]
            run_open_loop(engine, warm, arrivals[: len(warm)], opts.new_tokens, f"warmup-{workload}-{cache}")

    results: dict = dict(
        mode=opts.mode,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        argv=sys.argv[1:],
        options={
            k: getattr(opts, k) for k in (*DEFAULTS["gpu"], "load", "burst", "seed", "max_running", "repeats")
        },
        setup_s=setup_s,
        arrival_span_s=arrivals[-1],
        capacity_req_s=capacity,
        capacity_burst=burst,
        capacity_probe=probe,
        rate=rate,
        runs={},
    )
    repeats: dict[str, list[dict]] = {}
    for rep in range(opts.repeats):
        for workload, jobs in loads.items():
            # Alternate which setting runs first: a shared machine's load drifts between runs.
            for cache in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                blocks.reset_prefix_cache(cache == "on")
                before = dict(
                    hit=engine.stats().prefix_cache_hit_tokens,
                    ev=blocks.num_evictions,
                    pre=engine.scheduler.num_preemptions,
                )
                r = run_open_loop(engine, jobs, arrivals, opts.new_tokens, f"{workload}-{cache}-{rep}")
                r["hit_tokens"] -= sum(before["hit"].values())
                r["evictions"] -= before["ev"]
                r["preemptions"] -= before["pre"]
                repeats.setdefault(f"{workload}/{cache}", []).append(r)
                log.info("%s cache %s: %s", workload, cache, r)
    results["repeats"] = repeats
    results["runs"] = {
        key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in repeats.items()
    }
    blocks.reset_prefix_cache(True)
    runs = results["runs"]
    results["shared_ttft_p50_ratio"] = runs["shared/off"]["ttft_p50_ms"] / runs["shared/on"]["ttft_p50_ms"]
    results["shared_tok_s_ratio"] = runs["shared/on"]["output_tok_s"] / runs["shared/off"]["output_tok_s"]
    results["unique_tok_s_ratio"] = runs["unique/on"]["output_tok_s"] / runs["unique/off"]["output_tok_s"]
    print_table(results)
    write_json(opts.out, "prefix_cache", results)


def print_table(res: dict) -> None:
    o = res["options"]
    print(
        f"\n{res['device']}: {o['requests']} requests over {o['adapters']} adapters at {res['rate']:.2f}/s "
        f"(Poisson; {res['rate'] / res['capacity_req_s']:.2f}x the cache-off capacity of "
        f"{res['capacity_req_s']:.2f}/s), prompts {o['system_tokens']} shared + {o['unique_tokens']} "
        f"own tokens, {o['new_tokens']} new"
    )
    print(
        f"{'workload':<8} {'cache':<5} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'out tok/s':>10} "
        f"{'span s':>7} {'hit/prompt':>11} {'evict':>6} {'preempt':>7} {'steps':>6} {'tok/step':>8} "
        f"{'sched us/step':>13} {'CPU s':>7}"
    )
    for key, r in res["runs"].items():
        workload, cache = key.split("/")
        print(
            f"{workload:<8} {cache:<5} {r['ttft_p50_ms']:>12.1f} {r['ttft_p90_ms']:>12.1f} "
            f"{r['output_tok_s']:>10.1f} {r['span_s']:>7.1f} {r['hit_tokens'] / r['prompt_tokens']:>11.2f} "
            f"{r['evictions']:>6} "
            f"{r['preemptions']:>7} {r['steps']:>6.0f} {r['tokens_per_step']:>8.1f} "
            f"{r['schedule_us_per_step']:>13.1f} {r['cpu_s']:>7.1f}"
        )
    print(
        f"shared: TTFT p50 {res['shared_ttft_p50_ratio']:.2f}x lower (goal >= 4x), output tok/s "
        f"{res['shared_tok_s_ratio']:.2f}x (goal >= 1.3x); unique: output tok/s on/off "
        f"{res['unique_tok_s_ratio']:.3f} (goal >= 0.98)"
    )
    print(
        f"arrivals span {res['arrival_span_s']:.1f} s: a run whose span is longer was saturated "
        f"(its tok/s is the server's, not the offered rate)"
    )


if __name__ == "__main__":
    main()
