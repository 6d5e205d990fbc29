"""Open-loop multi-tenant workload: requests arrive on their own clock, each naming an adapter.

Arrivals are Poisson (or Gamma with burstiness `--cv`) at `--rate` requests/s for `--window`
seconds; prompt and output lengths are uniform over their ranges (outputs with `ignore_eos`);
each request draws its adapter from a Zipf(`--zipf-exponent`) popularity over N adapters, a
uniform one, or none (the base model). Every scenario replays the *same* arrival times, lengths,
prompts and popularity draws (one seed); scenarios differ in N and in the server's adapter flags.
Requests still open `--drain` seconds after the window closes are cancelled and counted as cut.

Three targets:
    --mode engine  the engine in-process (build_engine's parts), on a Llama-3.1-8B-shaped random
                   model and random rank-16 q/k/v/o adapters written by bench/serving_setup.py
                   (GPU; the model is loaded once, the engine rebuilt per scenario)
    --mode cpu     the same on the CPU with a tiny random model (CI-sized smoke runs)
    --mode grpc    a running inference server (--target), streaming: TTFT = first streamed token;
                   N adapters = the first N the server lists, slots are the server's own flags

Scenario names: `base`, or `POPULARITY:N[:K][:pool=P]` with POPULARITY zipf|uniform, N adapters,
K = `--max-loras-per-batch` and P = `--max-gpu-loras` (absent = default flags). Report per scenario:
completed, errors, cut, output tokens/s inside the window, TTFT / inter-token / end-to-end p50 p90
p99, mean running and waiting requests, adapter uploads and evictions, and ratios to the `base`
scenario; for Zipf scenarios also the S hottest adapters' TTFT and the others' (S = K, else P, else
8), queue time (arrival to first scheduled, from the engine) by popularity decile, and swaps
(evictions: a resident adapter replaced, each costing an upload) per second. Prints markdown
tables (the main one, issue 34's goal table, the deciles), writes workload.json to --out DIR
(bench/results.py).

    PYTHONPATH=protos python3 -m loraplex.bench.workload --mode engine --window 40 --drain 15
    PYTHONPATH=protos python3 -m loraplex.bench.workload --mode cpu --rate 60 --window 20
    # issue 34's scarce-slot scenarios (the H200 run of record: --window 45 --drain 10)
    PYTHONPATH=protos python3 -m loraplex.bench.workload \
        --scenarios base zipf:64:8 zipf:256:16 zipf:64:pool=16 zipf:64

Here: the flags and the scenario loop. The scenarios, the arrivals and the driver that sends them
are bench/workload_arrivals.py's; the summary, the ratios and the tables bench/workload_report.py's;
the targets bench/workload_targets.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.workload_arrivals import Scenario, drive, make_arrivals
from loraplex.bench.workload_report import add_ratios, print_deciles, print_goal_table, print_table, summarize
from loraplex.bench.workload_targets import open_target

GPU_SCENARIOS = ("base", "zipf:8:8", "zipf:64:64", "zipf:64", "zipf:256", "zipf:64:8")
CPU_SCENARIOS = ("base", "zipf:64", "zipf:64:8")


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--mode", choices=["engine", "cpu", "grpc"], default="engine")
    a("--tiny", action="store_true", help="engine mode with the tiny random model (a GPU smoke run)")
    a(
        "--scenarios",
        nargs="*",
        default=None,
        help=f"default: engine {' '.join(GPU_SCENARIOS)}; "
        f"cpu {' '.join(CPU_SCENARIOS)}; grpc: base zipf:N for the server's N adapters",
    )
    a("--rate", type=float, default=None, help="requests/s (default: engine 32, cpu 40, grpc 8)")
    a("--cv", type=float, default=1.0, help="coefficient of variation of the gaps (1 = Poisson; >1 bursty)")
    a("--window", type=float, default=60.0, help="seconds of arrivals; tokens/s counts tokens inside it")
    a("--drain", type=float, default=20.0, help="seconds after the window before open requests are cut")
    a(
        "--prompt-len",
        type=parse_range,
        default=None,
        help="LO,HI tokens (default: engine 256,768; cpu 16,64)",
    )
    a("--output-len", type=parse_range, default=None, help="LO,HI tokens (default: engine 64,256; cpu 16,48)")
    a("--zipf-exponent", type=float, default=1.0)
    a("--seed", type=int, default=0)
    a(
        "--adapter-rank",
        type=int,
        default=None,
        help="rank of the random adapters (default: engine 16, cpu 8)",
    )
    a(
        "--workdir",
        type=Path,
        default=None,
        help="where the random model and adapters are written (kept and reused; default: a cache dir)",
    )
    a("--target", default=None, help="grpc mode: HOST:PORT of a running inference server")
    a("--token", default=os.environ.get("LORAPLEX_API_TOKEN"), help="grpc mode: API token")
    a(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="engine/cpu modes: extra ServerArgs field for every scenario, e.g. max_running_requests=256",
    )
    add_out_argument(p)
    return p


MODE_DEFAULTS = {  # rate, prompt, output, rank
    "engine": (32.0, (256, 768), (64, 256), 16),
    "cpu": (40.0, (16, 64), (16, 48), 8),
    "grpc": (8.0, (256, 768), (64, 256), 16),
}


async def run(opts: argparse.Namespace, on_scenario=None) -> dict:
    """Every scenario in turn; `on_scenario(name, result)` (optional) is called after each and returns
    False to stop there (bench/goals.py: a time budget)."""
    rate, prompt_len, output_len, rank = MODE_DEFAULTS[opts.mode]
    opts.rate = opts.rate or rate
    opts.prompt_len = opts.prompt_len or prompt_len
    opts.output_len = opts.output_len or output_len
    opts.adapter_rank = opts.adapter_rank or rank
    names = opts.scenarios or {"engine": GPU_SCENARIOS, "cpu": CPU_SCENARIOS, "grpc": None}[opts.mode]
    results: dict[str, dict] = {}
    async with open_target(opts) as factory:
        if names is None:
            names = ("base", f"zipf:{factory.num_adapters}")
        scenarios = [Scenario.parse(n) for n in names]
        factory.prepare(max(sc.num_adapters for sc in scenarios))
        arrivals = make_arrivals(
            opts.rate, opts.window, opts.cv, opts.prompt_len, opts.output_len, factory.vocab_range, opts.seed
        )
        for sc in scenarios:
            built = time.perf_counter()
            async with factory.scenario(sc.num_adapters, sc.max_loras_per_batch, sc.max_gpu_loras) as target:
                build_s = time.perf_counter() - built
                adapters = [
                    None
                    if (i := sc.adapter_index(a.draw, opts.zipf_exponent)) is None
                    else target.adapter_names[i]
                    for a in arrivals
                ]
                before = target.counters()
                records, samples, elapsed = await drive(target, arrivals, adapters, opts.window, opts.drain)
                after = target.counters()
                counters = {k: (after[k] - before[k] if after[k] is not None else None) for k in after}
                # Zipf index i is the i-th most popular adapter.
                ranks = {n: i for i, n in enumerate(target.adapter_names)} if sc.popularity == "zipf" else {}
                res = summarize(records, samples, opts.window, counters, ranks, sc.hot_count, elapsed)
                res.update(
                    scenario=asdict(sc),
                    build_s=round(build_s, 1),
                    elapsed_s=round(elapsed, 1),
                    setup=target.describe(),
                )
                results[sc.name] = res
                ttft, itl = res["ttft_ms"], res["itl_ms"]
                print(
                    f"{sc.name}: {res['completed']}/{res['requests']} done, {res['cut']} cut, "
                    f"{res['errors']} errors, {res['output_tok_s']} tok/s, TTFT p50/p99 {ttft['p50']}/"
                    f"{ttft['p99']} ms, inter-token p50/p99 {itl['p50']}/{itl['p99']} ms "
                    f"(built in {build_s:.0f} s, {res['setup']})",
                    flush=True,
                )
            if on_scenario is not None and not on_scenario(sc.name, res):
                break
    add_ratios(results)
    return results


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("loraplex.services.inference.lora.setup").setLevel(logging.INFO)
    results = asyncio.run(run(opts))
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        command=" ".join(sys.argv),
        mode=opts.mode,
        rate=opts.rate,
        cv=opts.cv,
        window_s=opts.window,
        drain_s=opts.drain,
        prompt_len=opts.prompt_len,
        output_len=opts.output_len,
        zipf_exponent=opts.zipf_exponent,
        seed=opts.seed,
        adapter_rank=opts.adapter_rank,
    )
    print(
        f"\n{opts.mode}: {opts.rate} req/s (cv {opts.cv}) for {opts.window} s, cut {opts.drain} s later; "
        f"prompts {opts.prompt_len}, outputs {opts.output_len} tokens; {meta['date']}, {meta['machine']}"
    )
    print_table(results)
    print_goal_table(results)
    print_deciles(results)
    write_json(opts.out, "workload", {"meta": meta, "scenarios": results})
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
