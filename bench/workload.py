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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.workload_targets import Target, open_target

GPU_SCENARIOS = ("base", "zipf:8:8", "zipf:64:64", "zipf:64", "zipf:256", "zipf:64:8")
CPU_SCENARIOS = ("base", "zipf:64", "zipf:64:8")
HOT_ADAPTERS = 8  # the report's "hot" TTFT: requests of the S most popular Zipf adapters, S = K, P or this
DECILES = 10


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the window opens
    prompt_ids: list[int]
    max_new_tokens: int
    draw: float  # uniform in [0, 1): picks the adapter, the same draw in every scenario


@dataclass(frozen=True)
class Scenario:
    name: str
    popularity: str  # base | zipf | uniform
    num_adapters: int = 0
    max_loras_per_batch: int | None = None  # None: the server's default flags
    max_gpu_loras: int | None = None  # None: the server's default pool bound
    hot: int | None = None  # S of the hottest-S TTFT (None: K, else P, else HOT_ADAPTERS)

    @classmethod
    def parse(cls, text: str) -> Scenario:
        if text == "base":
            return cls("base", "base")
        parts = text.split(":")
        usage = (
            f"scenario {text!r}: use 'base' or "
            "'zipf|uniform:N[:MAX_LORAS_PER_BATCH][:pool=MAX_GPU_LORAS][:hot=S]'"
        )
        if parts[0] not in ("zipf", "uniform") or not 2 <= len(parts) <= 5:
            raise ValueError(usage)
        k = pool = hot = None
        for part in parts[2:]:
            if part.startswith("pool="):
                pool = int(part.removeprefix("pool="))
            elif part.startswith("hot="):
                hot = int(part.removeprefix("hot="))
            elif part.isdigit() and k is None:
                k = int(part)
            else:
                raise ValueError(usage)
        return cls(text, parts[0], int(parts[1]), k, pool, hot)

    @property
    def hot_count(self) -> int:
        """S: the adapters counted as hot (hot=S, else the cap, else the pool bound, else HOT_ADAPTERS)."""
        return self.hot or self.max_loras_per_batch or self.max_gpu_loras or HOT_ADAPTERS

    def adapter_index(self, draw: float, exponent: float) -> int | None:
        if self.popularity == "base":
            return None
        if self.popularity == "uniform":
            return min(int(draw * self.num_adapters), self.num_adapters - 1)
        weights = 1.0 / np.arange(1, self.num_adapters + 1) ** exponent
        cdf = np.cumsum(weights) / weights.sum()
        return int(min(np.searchsorted(cdf, draw, side="right"), self.num_adapters - 1))


def make_arrivals(
    rate: float,
    window: float,
    cv: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: tuple[int, int],
    seed: int,
) -> list[Arrival]:
    """Arrival times in [0, window): exponential gaps (cv 1) or Gamma gaps with that coefficient of
    variation."""
    rng = np.random.default_rng(seed)
    out: list[Arrival] = []
    t = 0.0
    while True:
        if cv == 1.0:
            t += rng.exponential(1.0 / rate)
        else:
            shape = 1.0 / cv**2
            t += rng.gamma(shape, 1.0 / (rate * shape))
        if t >= window:
            return out
        n_prompt = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        ids = rng.integers(vocab[0], vocab[1], size=n_prompt).tolist()
        out.append(Arrival(t, ids, int(rng.integers(output_len[0], output_len[1] + 1)), float(rng.random())))


@dataclass
class Record:
    adapter: str | None
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per streamed message ...
    token_counts: list[int] = field(default_factory=list)  # ... and how many tokens it carried
    queue_time: float | None = None  # arrival to first scheduled, as the engine measured it
    done: bool = False
    error: str | None = None


async def _one(target: Target, rid: str, arrival: Arrival, rec: Record, t0: float) -> None:
    rec.start = time.perf_counter() - t0
    try:
        async for n, queued in target.stream(rid, arrival.prompt_ids, rec.adapter, arrival.max_new_tokens):
            if queued is not None and rec.queue_time is None:
                rec.queue_time = queued
            if n:
                rec.token_times.append(time.perf_counter() - t0)
                rec.token_counts.append(n)
        rec.done = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # counted, not fatal: the report says how many and which
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def drive(
    target: Target, arrivals: list[Arrival], adapters: list[str | None], window: float, drain: float
) -> tuple[list[Record], list[tuple[int, int]], float]:
    """Send every arrival at its time, sample the engine's queue, cut what is open at window + drain."""
    records = [Record(a) for a in adapters]
    samples: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    tasks: list[asyncio.Task] = []

    async def sample() -> None:
        while time.perf_counter() - t0 < window:
            s = target.queue_sizes()
            if s is not None:
                samples.append(s)
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    for i, arrival in enumerate(arrivals):
        delay = arrival.at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(target, f"w{i}", arrival, records[i], t0)))
    remaining = window + drain - (time.perf_counter() - t0)
    if tasks:
        await asyncio.wait(tasks, timeout=max(remaining, 0.0))
    elapsed = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, sampler, return_exceptions=True)
    return records, samples, elapsed


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(values, [50, 90, 99]) * 1000
    return {"p50": round(float(p[0]), 1), "p90": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def summarize(
    records: list[Record],
    samples: list[tuple[int, int]],
    window: float,
    counters: dict,
    ranks: dict[str, int] | None = None,
    hot_count: int = HOT_ADAPTERS,
    elapsed: float | None = None,
) -> dict:
    """`ranks`: adapter name -> popularity rank (0 = most popular), for the hot / other / decile splits."""
    ranks = ranks or {}
    ttft, hot_ttft, other_ttft, itl, e2e, tokens_in_window = [], [], [], [], [], 0
    deciles: list[list[float]] = [[] for _ in range(DECILES)]
    for r in records:
        rank = ranks.get(r.adapter) if r.adapter is not None else None
        if r.token_times:
            ttft.append(r.token_times[0] - r.start)
            if rank is not None:
                (hot_ttft if rank < hot_count else other_ttft).append(ttft[-1])
        if rank is not None and r.queue_time is not None:
            deciles[rank * DECILES // len(ranks)].append(r.queue_time)
        last = None
        for t, n in zip(r.token_times, r.token_counts, strict=True):
            if t <= window:
                tokens_in_window += n
            if last is not None:  # a message may carry several tokens: spread the gap over them
                itl.extend([(t - last) / n] * n)
            last = t
        if r.done and r.token_times:
            e2e.append(r.token_times[-1] - r.start)
    done = sum(r.done for r in records)
    errors = sum(r.error is not None for r in records)
    running = [s[0] for s in samples]
    waiting = [s[1] for s in samples]
    evictions = counters.get("evictions")
    return dict(
        requests=len(records),
        completed=done,
        errors=errors,
        cut=len(records) - done - errors,
        error_examples=sorted({r.error for r in records if r.error})[:3],
        output_tok_s=round(tokens_in_window / window, 1),
        ttft_ms=_pcts(ttft),
        itl_ms=_pcts(itl),
        e2e_ms=_pcts(e2e),
        hot_adapters=hot_count if ranks else 0,
        hot_ttft_ms=_pcts(hot_ttft),  # requests of the hot_adapters most popular adapters
        other_ttft_ms=_pcts(other_ttft),  # every other adapter's requests
        # queue time (arrival to first scheduled) of each popularity decile's requests, hottest first
        queue_ms_by_decile=[_pcts(d) for d in deciles] if ranks else [],
        swaps_per_s=round(evictions / elapsed, 2) if evictions is not None and elapsed else None,
        mean_running=round(float(np.mean(running)), 1) if running else None,
        mean_waiting=round(float(np.mean(waiting)), 1) if waiting else None,
        **counters,
    )


def add_ratios(results: dict[str, dict]) -> None:
    base = results.get("base")
    if base is None:
        return
    for res in results.values():
        ratios = {
            "output_tok_s": _ratio(res["output_tok_s"], base["output_tok_s"]),
            "mean_running": _ratio(res["mean_running"], base["mean_running"]),
        }
        ratios["hot_ttft_ms_p99"] = _ratio(res["hot_ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        ratios["other_ttft_ms_p99"] = _ratio(res["other_ttft_ms"]["p99"], base["ttft_ms"]["p99"])
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            for q in ("p50", "p90", "p99"):
                ratios[f"{key}_{q}"] = _ratio(res[key][q], base[key][q])
        res["vs_base"] = ratios


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _fmt(v, ratio=None) -> str:
    if v is None:
        return "-"
    text = f"{v:,.0f}" if isinstance(v, float) and v >= 100 else f"{v}"
    return f"{text} ({ratio:.2f})" if ratio is not None else text


def print_table(results: dict[str, dict]) -> None:
    print(
        "| scenario | done / sent | errors | cut | output tok/s (vs base) | TTFT p50 / p99 ms | "
        "S hottest TTFT p99 ms | inter-token p50 / p99 ms | e2e p50 / p99 ms | "
        "mean running / waiting | uploads / evictions |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        vs = r.get("vs_base", {})
        print(
            f"| {name} | {r['completed']}/{r['requests']} | {r['errors']} | {r['cut']} "
            f"| {_fmt(r['output_tok_s'], vs.get('output_tok_s'))} "
            f"| {_fmt(r['ttft_ms']['p50'])} / {_fmt(r['ttft_ms']['p99'], vs.get('ttft_ms_p99'))} "
            f"| {_fmt(r['hot_ttft_ms']['p99'], vs.get('hot_ttft_ms_p99'))} (S={r.get('hot_adapters', 0)}) "
            f"| {_fmt(r['itl_ms']['p50'])} / {_fmt(r['itl_ms']['p99'])} "
            f"| {_fmt(r['e2e_ms']['p50'])} / {_fmt(r['e2e_ms']['p99'])} "
            f"| {_fmt(r['mean_running'])} / {_fmt(r['mean_waiting'])} "
            f"| {_fmt(r['uploads'])} / {_fmt(r['evictions'])} |"
        )


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def print_goal_table(results: dict[str, dict]) -> None:
    """Issue 34's goal table: ratios to the base scenario of the same run."""
    print(
        "\n| scenario | tok/s | TTFT p99 | S hottest TTFT p99 | others' TTFT p99 | swaps/s | uploads |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for name, r in results.items():
        vs = r.get("vs_base", {})
        print(
            f"| {name} | {_x(vs.get('output_tok_s'))} | {_x(vs.get('ttft_ms_p99'))} "
            f"| {_x(vs.get('hot_ttft_ms_p99'))} (S={r.get('hot_adapters', 0)}) "
            f"| {_x(vs.get('other_ttft_ms_p99'))} | {_fmt(r.get('swaps_per_s'))} | {_fmt(r.get('uploads'))} |"
        )


def print_deciles(results: dict[str, dict]) -> None:
    rows = {n: r["queue_ms_by_decile"] for n, r in results.items() if r.get("queue_ms_by_decile")}
    if not rows:
        return
    print(
        "\nqueue time (arrival to first scheduled) p50 / p99 ms by adapter popularity decile, hottest first\n"
        "| scenario | " + " | ".join(f"d{i}" for i in range(DECILES)) + " |\n"
        "| --- |" + " ---: |" * DECILES
    )
    for name, deciles in rows.items():
        cells = " | ".join(f"{_fmt(d['p50'])} / {_fmt(d['p99'])}" for d in deciles)
        print(f"| {name} | {cells} |")


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
