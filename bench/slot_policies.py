"""Adapter-slot policies compared on a virtual clock: the real Scheduler and LoRAManager, no model.

bench/workload.py measures the engine, but on a shared CPU its numbers move with the machine's load
more than with the policy. This replays the same open-loop arrivals (loraplex.bench.workload.make_arrivals:
Poisson, Zipf adapters) through the real scheduler and LoRA manager (a tiny CPU pool; uploads are
real copies) and advances a virtual clock by a step-cost model fitted to the H200 measurements in
docs/benchmarks.md (Llama-3.1-8B shape): a step costs

    6.5 ms + 0.01 ms per decode + 0.031 ms per prefill token
           + (LoRA in the step) 2.0 ms + 0.05 ms per distinct adapter

so scheduling effects (who waits, how full the batch is, how many adapters per step) are measured
exactly and step speed only roughly. A request's first token comes at the end of the step that
samples it. Policies (`--policies`):

    slices   the engine's: demand-weighted time slices (engine/adapter_slices.py); slices-waitN:
             the same with max_wait N steps
    turns    the issue's first proposal: K/2 places kept by the hottest adapters while they have
             requests, K/2 turn places rotating over the rest in arrival order, 4 steps a turn
    drains   before issue 34: the cap sized the pool (K slots), slots drained for waiting adapters

Scenarios as in bench/workload.py (`base`, `zipf:N[:K][:pool=P]`). Prints the goal table, writes
slot_policies.json to --out DIR.

    PYTHONPATH=protos python3 -m loraplex.bench.slot_policies --window 60
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.workload import DECILES, Scenario, make_arrivals

STEP_MS = dict(base=6.5, decode=0.01, prefill=0.031, lora=2.0, per_adapter=0.05)


class TurnsPolicy:
    """The compared policy: hot places kept while they have requests, plus rotating turns."""

    def __init__(self, cap: int, quantum: int = 4):
        self.cap = cap
        self.turn_places = max(1, cap // 2)
        self.hot_places = cap - self.turn_places
        self.quantum = quantum
        self.hot: list[str] = []
        self.turns: dict[str, int] = {}
        self.queue: dict[str, None] = {}

    def select(self, running, waiting) -> frozenset[str]:
        from loraplex.services.inference.engine.adapter_slices import adapter_work

        work = adapter_work(running, waiting)
        self.hot = [a for a in self.hot if work[a]]
        for name in list(self.turns):
            if not work[name] or self.turns[name] <= 0:
                del self.turns[name]
                if work[name]:
                    self.queue[name] = None
        for name in [n for n in self.queue if not work[n]]:
            del self.queue[name]
        placed = set(self.hot) | set(self.turns)
        for name in work:
            if name not in placed:
                self.queue.setdefault(name, None)
        while len(self.hot) < self.hot_places and (self.queue or self.turns):
            best = max([*self.queue, *self.turns], key=lambda n: work[n])
            self.queue.pop(best, None)
            self.turns.pop(best, None)
            self.hot.append(best)
        while len(self.turns) < self.turn_places and self.queue:
            name = next(iter(self.queue))
            del self.queue[name]
            self.turns[name] = self.quantum
        for name in self.turns:
            self.turns[name] -= 1
        return frozenset(self.hot) | frozenset(self.turns)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(sc: Scenario, policy: str, adapters: list, shapes, clock: Clock, kv_blocks: int, max_running: int):
    from loraplex.services.inference.engine.block_manager import BlockManager
    from loraplex.services.inference.engine.config import EngineConfig
    from loraplex.services.inference.engine.scheduler import Scheduler
    from loraplex.services.inference.lora.manager import LoRAManager
    from loraplex.services.inference.lora.pool import AdapterPool
    from loraplex.services.inference.lora.settings import DEFAULT_MAX_GPU_LORAS

    cap = sc.max_loras_per_batch
    slots = sc.max_gpu_loras or DEFAULT_MAX_GPU_LORAS["cuda"]
    if policy == "drains" and cap is not None:
        slots, cap = cap, None  # the old meaning: the cap sized the pool
    pool = AdapterPool(
        shapes, slots=slots, max_rank=8, target_modules=("q_proj",), dtype=torch.float32, device="cpu"
    )
    manager = LoRAManager(pool, max_loras_per_batch=cap, clock=clock)
    for i, path in enumerate(adapters[: sc.num_adapters]):
        manager.load_adapter(f"a{i:03d}", path)
    config = EngineConfig(device="cpu", max_running_requests=max_running).scheduler_config(8192)
    scheduler = Scheduler(config, BlockManager(kv_blocks, config.page_size), manager)
    if policy == "turns" and cap is not None:
        scheduler.adapter_slices = TurnsPolicy(cap)
    elif policy.startswith("slices-wait") and cap is not None:  # slices-waitN: max_wait N steps
        scheduler.adapter_slices.max_wait = int(policy.removeprefix("slices-wait"))
    return scheduler, manager


def step_seconds(entries) -> float:
    decodes = sum(1 for _, n in entries if n == 1)
    prefill = sum(n for _, n in entries if n > 1)
    distinct = len({r.adapter for r, _ in entries if r.adapter is not None})
    ms = STEP_MS["base"] + STEP_MS["decode"] * decodes + STEP_MS["prefill"] * prefill
    if distinct:
        ms += STEP_MS["lora"] + STEP_MS["per_adapter"] * distinct
    return ms / 1000


def simulate(sc: Scenario, policy: str, arrivals, opts, adapters, shapes) -> dict:
    from loraplex.services.inference.engine.request import Request
    from loraplex.services.inference.engine.types import SamplingParams

    clock = Clock()
    scheduler, manager = build(sc, policy, adapters, shapes, clock, opts.kv_blocks, opts.max_running)
    names = [None if (i := sc.adapter_index(a.draw, 1.0)) is None else f"a{i:03d}" for a in arrivals]
    reqs: list[Request] = []
    first: dict[int, float] = {}
    queued: dict[int, float] = {}
    tokens_in_window, steps, distinct_sum, running_sum = 0, 0, 0, 0
    nxt = 0
    end = opts.window + opts.drain
    wall = time.perf_counter()
    while clock.now < end:
        while nxt < len(arrivals) and arrivals[nxt].at <= clock.now:
            a = arrivals[nxt]
            r = Request(str(nxt), a.prompt_ids, SamplingParams(max_new_tokens=a.max_new_tokens), names[nxt])
            r.arrival_time = a.at
            reqs.append(r)
            scheduler.add(r)
            nxt += 1
        if not scheduler.has_work():
            if nxt >= len(arrivals):
                break
            clock.now = arrivals[nxt].at
            continue
        batch = scheduler.schedule()
        if not batch.entries:
            clock.now += 0.001
            continue
        started = clock.now
        clock.now += step_seconds(batch.entries)
        steps += 1
        running_sum += len(scheduler.running)
        distinct_sum += len({r.adapter for r, _ in batch.entries if r.adapter is not None})
        for r, n in batch.entries:
            k = int(r.request_id)
            queued.setdefault(k, started - r.arrival_time)
            sample = r.num_computed_tokens + n == len(r.token_ids)
            r.num_computed_tokens += n
            if sample:
                r.token_ids.append(7)
                first.setdefault(k, clock.now - r.arrival_time)
                if clock.now <= opts.window:
                    tokens_in_window += 1
                if r.num_output_tokens >= r.max_new_tokens:
                    scheduler.finish(r, "length")
    ranks = {f"a{i:03d}": i for i in range(sc.num_adapters)}
    hot_n = sc.hot_count
    ttft = [first[k] for k in first]
    hot = [first[k] for k in first if names[k] is not None and ranks[names[k]] < hot_n]
    other = [first[k] for k in first if names[k] is not None and ranks[names[k]] >= hot_n]
    deciles: list[list[float]] = [[] for _ in range(DECILES)]
    for k, q in queued.items():
        if names[k] is not None:
            deciles[ranks[names[k]] * DECILES // sc.num_adapters].append(q)
    evictions = sum(i.evictions for i in manager.list_adapters())
    return dict(
        requests=len(arrivals),
        unfinished=sum(1 for r in reqs if not r.finished) + len(arrivals) - nxt,
        output_tok_s=round(tokens_in_window / opts.window, 1),
        ttft_ms=_pcts(ttft),
        hot_ttft_ms=_pcts(hot),
        other_ttft_ms=_pcts(other),
        queue_ms_by_decile=[_pcts(d) for d in deciles] if sc.num_adapters else [],
        hot_adapters=hot_n if sc.num_adapters else 0,
        uploads=manager.num_uploads,
        swaps_per_s=round(evictions / max(clock.now, 1e-9), 2),
        mean_distinct_per_step=round(distinct_sum / max(steps, 1), 2),
        mean_running=round(running_sum / max(steps, 1), 1),
        steps=steps,
        sim_seconds=round(clock.now, 1),
        wall_seconds=round(time.perf_counter() - wall, 1),
    )


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p = np.percentile(values, [50, 99]) * 1000
    return {"p50": round(float(p[0]), 1), "p99": round(float(p[1]), 1)}


def _x(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="*", default=["base", "zipf:64:8", "zipf:256:16", "zipf:64:pool=16"])
    p.add_argument("--policies", nargs="*", default=["slices", "turns", "drains"])
    p.add_argument("--rate", type=float, default=32.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--drain", type=float, default=30.0)
    p.add_argument("--kv-blocks", type=int, default=36000, help="16-token blocks (an H200's 8B KV: ~36k)")
    p.add_argument("--max-running", type=int, default=256, help="--max-running-requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/loraplex-slot-policies")
    add_out_argument(p)
    opts = p.parse_args(argv)
    from loraplex.bench.serving_setup import write_adapters, write_model_dir
    from loraplex.bench.workload_targets import TINY
    from loraplex.services.inference.lora.shapes import ModelShapes

    root = Path(opts.workdir)
    scenarios = [Scenario.parse(s) for s in opts.scenarios]
    need = max(sc.num_adapters for sc in scenarios)
    model = root / "model"
    if not (model / "model.safetensors.index.json").exists():
        write_model_dir(model, TINY, device="cpu")
    adapters = sorted(p.parent for p in (root / "adapters").glob("adapter*/adapter_config.json"))
    if len(adapters) < need:
        adapters = sorted(
            write_adapters(
                root / "adapters", model, need, shape=TINY, rank=8, device="cpu", modules=("q_proj",)
            )
        )
    shapes = ModelShapes.from_model_dir(model)
    arrivals = make_arrivals(opts.rate, opts.window, 1.0, (256, 768), (64, 256), (1, 500), opts.seed)
    results: dict[str, dict] = {}
    for sc in scenarios:
        for policy in opts.policies if sc.max_loras_per_batch else opts.policies[:1]:
            key = sc.name if sc.max_loras_per_batch is None else f"{sc.name} {policy}"
            results[key] = res = simulate(sc, policy, arrivals, opts, adapters, shapes)
            print(f"{key}: {res}", file=sys.stderr, flush=True)
    base = results.get("base")
    print(
        f"\nvirtual clock, {opts.rate} req/s for {opts.window} s, prompts 256-768, outputs 64-256\n"
        "| scenario | tok/s | TTFT p50 / p99 ms | TTFT p99 | S hottest TTFT p99 | others' TTFT p99 "
        "| distinct / step | swaps/s | uploads | unfinished |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for key, r in results.items():
        b99 = base["ttft_ms"]["p99"] if base else None
        print(
            f"| {key} | {_x(r['output_tok_s'], base and base['output_tok_s'])} "
            f"| {r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} | {_x(r['ttft_ms']['p99'], b99)} "
            f"| {_x(r['hot_ttft_ms']['p99'], b99)} (S={r['hot_adapters']}) "
            f"| {_x(r['other_ttft_ms']['p99'], b99)} "
            f"| {r['mean_distinct_per_step']} | {r['swaps_per_s']} | {r['uploads']} | {r['unfinished']} |"
        )
    write_json(opts.out, "slot_policies", {"step_ms": STEP_MS, "scenarios": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
