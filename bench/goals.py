"""One command for the whole GPU goal table: every row of bench/goal_table.py measured in one process, a
table with each goal beside its figure (met / missed), JSON to --out.

    PYTHONPATH=protos python3 -m loraplex.bench.goals [--out DIR]          # H100 / H200: <= 9 minutes
    PYTHONPATH=protos python3 -m loraplex.bench.goals --tiny               # tiny model (CPU: ~1 minute)

The measures run in turn, each within its budget (a measure that no longer fits the remaining
`--budget-s` is skipped and says so), each row's ratio taken side by side in the same process:
- decode: the bf16, FP8 and FP8 + FP8-KV decode steps, batch 64 at context 1,024 of a
  Llama-3.1-8B-shaped random model (bench/step.py's cases), against each other and the memory floor;
- lora_layer: one decoder layer's LoRA at 64 tokens over 8 rank-16 adapters against its floor
  (bench/kernels.py; CUDA only);
- adapter_kinds: issue 56's decode step, batch 64 over 8 adapters of which 2 DoRA and 2 with
  embedding / lm_head LoRA, against 8 plain adapters (bench/adapter_kinds.py);
- speculation: issue 58's inter-token latency with n-gram speculation on / off at batch 1 / 8 / 32,
  base and 8 adapters, and batch-64 throughput, acceptance forced to 0.7 at K = 4 (bench/speculation.py);
- workload: the open-loop workload of issue 57 (bench/workload.py, --mode engine: Poisson 25 req/s,
  prompts 256-768, outputs 64-256, rank-16 q/k/v/o adapters, Zipf 1), base then 64 Zipf adapters on
  16 slots, 256 on 32, 1,024 at default flags, 64 and 256 at default flags. The window is SHORTER
  than the issue's 40 s (`--window`, default 12 s, cut 10 s after) so that all of it fits one 9-minute
  device call; scenarios that no longer fit are skipped (named in the output).
Rows of issues not built yet print 'not built'; on the CPU, rows that need CUDA print 'needs CUDA'.
Progress lines carry timestamps and goals.json is rewritten after every measure and scenario, so a
run cut short still leaves what it measured. Exit status 1 when a measure failed (not for a missed goal).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from loraplex.bench import harness as h
from loraplex.bench.goal_table import GOALS, SCENARIOS, Goal, Measure
from loraplex.bench.results import add_out_argument, write_json


@dataclass
class Context:
    opts: argparse.Namespace
    device: object  # torch.device
    bandwidth: float | None
    rate: float | None
    deadline: float  # time.perf_counter() past which nothing new starts
    report: object  # () -> None: rewrite goals.json with what is measured so far
    partial: dict  # the running measure's results so far (the workload's scenarios)


def measure_decode(ctx: Context) -> dict:
    from loraplex.bench.step import run_decode

    tiny = ctx.opts.tiny
    o = argparse.Namespace(
        tiny=tiny,
        batch=4 if tiny else 64,
        context=32 if tiny else 1024,
        repeats=3 if tiny else 50,
        adapters=8,
    )
    return run_decode(o, ctx.device, ctx.bandwidth, keys=["base", "fp8", "fp8_kv8"])


def measure_lora_layer(ctx: Context) -> dict:
    from loraplex.bench.kernels import lora_layer, lora_scenario

    return lora_layer(lora_scenario(64, 8, 16), ctx.bandwidth, ctx.rate)


def workload_args(o: argparse.Namespace, cuda: bool) -> list[str]:
    keys = o.scenarios.split(",") if o.scenarios else list(SCENARIOS)
    names = [SCENARIOS[k][1 if o.tiny else 0] for k in keys]
    args = ["--mode", "engine" if cuda else "cpu", "--scenarios", *names]
    for pair in o.server_arg:
        args += ["--server-arg", pair]
    args += ["--window", str(o.window), "--drain", str(o.drain), "--rate", str(o.rate)]
    if o.tiny:  # short requests: the CPU decodes a few hundred tokens/s
        args += ["--prompt-len", "8,24", "--output-len", "4,12"] + (["--tiny"] if cuda else [])
    else:
        args += ["--prompt-len", "256,768", "--output-len", "64,256", "--adapter-rank", "16"]
    return [*args, "--workdir", str(goals_workdir(o, cuda))]


def measure_workload(ctx: Context) -> dict:
    from loraplex.bench import workload, workload_report

    opts = workload.build_parser().parse_args(workload_args(ctx.opts, ctx.device.type == "cuda"))
    keys = {(full_tiny[1 if ctx.opts.tiny else 0]): key for key, full_tiny in SCENARIOS.items()}
    spent: list[float] = []
    last = [time.perf_counter()]

    def on_scenario(name: str, res: dict) -> bool:
        now = time.perf_counter()
        spent.append(now - last[0])
        last[0] = now
        ctx.partial[keys[name]] = res
        workload_report.add_ratios(ctx.partial)
        vs = res.get("vs_base", {})
        h.log(
            f"workload {name}: {res['completed']}/{res['requests']} done, {res['output_tok_s']} tok/s "
            f"({vs.get('output_tok_s')}x base), TTFT p99 {res['ttft_ms']['p99']} ms "
            f"({vs.get('ttft_ms_p99')}x), took {spent[-1]:.0f} s"
        )
        ctx.report()
        if now + max(spent) > ctx.deadline and len(spent) < len(opts.scenarios):
            h.log(f"workload: stopping, the next scenario would pass the budget ({max(spent):.0f} s each)")
            return False
        return True

    h.log(
        f"workload: {' '.join(opts.scenarios)}; {opts.rate} req/s for {opts.window} s, "
        f"cut {opts.drain} s later"
    )
    asyncio.run(workload.run(opts, on_scenario))
    skipped = [n for n in opts.scenarios if keys[n] not in ctx.partial]
    if skipped:
        h.log(f"workload: skipped for the budget: {' '.join(skipped)}")
    return dict(ctx.partial)


def goals_workdir(o: argparse.Namespace, cuda: bool) -> Path:
    """Where the random model and adapters live (written once, shared by the measures that serve)."""
    return o.workdir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraplex" / (
        f"goals-{'tiny' if o.tiny else 'full'}-{'cuda' if cuda else 'cpu'}"
    )


def measure_speculation(ctx: Context) -> dict:
    from loraplex.bench.speculation import run

    return run(goals_workdir(ctx.opts, ctx.device.type == "cuda"), ctx.opts.tiny, ctx.device)


def measure_adapter_kinds(ctx: Context) -> dict:
    from loraplex.bench.adapter_kinds import measure

    return measure(ctx.opts.tiny, ctx.device)


MEASURES = [
    Measure("decode", 90, False, measure_decode),
    Measure("lora_layer", 30, True, measure_lora_layer),
    Measure("adapter_kinds", 40, False, measure_adapter_kinds),
    Measure("speculation", 100, False, measure_speculation),
    Measure("workload", 300, False, measure_workload),
]


def evaluate(goal: Goal, measured: dict, cuda: bool) -> tuple[float | None, str]:
    if goal.measure is None:
        return None, "not built"
    m = measured.get(goal.measure)
    if m is None:
        return None, "not run yet"
    if m["status"] != "ok" and m.get("result") is None:
        return None, m["status"]
    if goal.scenario is not None and goal.scenario not in (m.get("result") or {}):
        return None, "not run (budget or --scenarios)"
    value = goal.figure(m["result"])
    if value is None:
        return None, "not measured" if cuda else "needs CUDA"
    return value, "met" if goal.met(value) else "missed"


def table(measured: dict, cuda: bool) -> list[dict]:
    rows = []
    for g in GOALS:
        value, status = evaluate(g, measured, cuda)
        rows.append(
            dict(issue=g.issue, row=g.row, goal=g.goal, measure=g.measure, value=value, status=status)
        )
    return rows


def print_table(rows: list[dict]) -> None:
    h.print_table(
        ["issue", "row", "goal", "measured", "status"],
        [
            [
                r["issue"],
                r["row"],
                r["goal"],
                "-" if r["value"] is None else f"{r['value']:.2f}x",
                r["status"],
            ]
            for r in rows
        ],
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = h.suite_parser("goals", __doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=None, help="whole-run budget (default 540; --tiny 600)")
    p.add_argument(
        "--window", type=float, default=None, help="workload seconds of arrivals (default 12; --tiny 2)"
    )
    p.add_argument(
        "--drain", type=float, default=None, help="workload seconds before open requests are cut (10; 20)"
    )
    p.add_argument("--rate", type=float, default=None, help="workload requests/s (default 25; --tiny 15)")
    p.add_argument("--measures", default=",".join(m.name for m in MEASURES), help="comma-separated subset")
    p.add_argument(
        "--scenarios",
        default=None,
        help=f"workload scenarios, a comma-separated subset of {','.join(SCENARIOS)} (default: all; "
        "the ratios need base)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="workload: a ServerArgs field for every scenario, e.g. lora_memory=unified",
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="the workload's model and adapters (kept, reused)"
    )
    add_out_argument(p)
    o = p.parse_args(argv)
    unknown = set(o.scenarios.split(",")) - set(SCENARIOS) if o.scenarios else set()
    if unknown:
        p.error(f"--scenarios: no scenario {', '.join(sorted(unknown))} (known: {', '.join(SCENARIOS)})")
    o.budget_s = o.budget_s or (600 if o.tiny else 540)
    o.window = o.window or (2 if o.tiny else 12)
    o.drain = o.drain or (20 if o.tiny else 10)
    o.rate = o.rate or (15 if o.tiny else 25)
    return o


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    started = time.perf_counter()
    device = h.pick_device(o.device)
    cuda = device.type == "cuda"
    measured: dict[str, dict] = {}
    info = dict(
        meta=h.meta(device, o.tiny),
        budget_s=o.budget_s,
        workload=dict(window_s=o.window, drain_s=o.drain, rate=o.rate, server_args=o.server_arg),
    )

    def report() -> None:
        if ctx.partial and measured.get("workload", {}).get("status") == "running":
            measured["workload"]["result"] = dict(ctx.partial)
        write_json(o.out, "goals", dict(info, measures=measured, rows=table(measured, cuda)))

    ctx = Context(
        o, device, h.copy_bandwidth(device), h.matmul_rate(device), started + o.budget_s, report, {}
    )
    info.update(bandwidth=ctx.bandwidth, matmul_rate=ctx.rate)
    wanted = [m for m in MEASURES if m.name in o.measures.split(",")]
    h.log(
        f"goals on {info['meta']['device']} ({info['meta']['size']} size), budget {o.budget_s:.0f} s: "
        + ", ".join(f"{m.name} ~{m.budget_s:.0f} s" for m in wanted)
    )
    for m in wanted:
        left = ctx.deadline - time.perf_counter()
        if m.needs_cuda and not cuda:
            measured[m.name] = dict(status="needs CUDA", budget_s=m.budget_s)
            continue
        if not o.tiny and left < m.budget_s / 2:
            measured[m.name] = dict(status=f"skipped: {left:.0f} s of the budget left", budget_s=m.budget_s)
            h.log(f"{m.name}: skipped, {left:.0f} s left of the budget (it plans {m.budget_s:.0f} s)")
            continue
        h.log(f"{m.name}: start (plans {m.budget_s:.0f} s, {left:.0f} s left)")
        measured[m.name] = dict(status="running", budget_s=m.budget_s)
        t0 = time.perf_counter()
        try:
            result, status = m.run(ctx), "ok"
        except Exception as e:  # reported in the table and the exit status; the other measures still run
            traceback.print_exc()
            result, status = (dict(ctx.partial) or None), f"error: {type(e).__name__}: {e}"[:200]
        ctx.partial = {}
        measured[m.name] = dict(
            status=status, budget_s=m.budget_s, seconds=round(time.perf_counter() - t0, 1), result=result
        )
        h.free(device)
        h.log(f"{m.name}: {status} in {measured[m.name]['seconds']:.0f} s")
        report()
    rows = table(measured, cuda)
    print(
        f"\ngoal table, {info['meta']['device']} ({info['meta']['size']} size), {info['meta']['date']}, "
        f"workload window {o.window:g} s at {o.rate:g} req/s"
    )
    print_table(rows)
    if o.tiny:
        print("tiny size: the workload rows at an eighth of the adapters and slots (hottest 8, not 64)")
    if not cuda:
        print(
            "CPU: the float base is fp32 and FP8 runs the dequantizing reference: not the goals' conditions"
        )
    report()
    h.log(f"done in {time.perf_counter() - started:.0f} s")
    return 1 if any(v["status"].startswith("error") for v in measured.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
