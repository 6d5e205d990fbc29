"""The GPU goal table as a registry: what bench/goals.py measures and what each figure is held to.

A Measure is one piece of work run once per goals run (its rows' ratios come from the same process,
side by side): a name, its time budget on the GPU (seconds), whether it needs CUDA, and `run(ctx)`
returning a dict. A Goal is one row: the issue it belongs to, what it measures, the bound ("<=" or
">=" a ratio), the Measure it reads and `figure(result)` that picks its ratio out. A row with no
Measure is a placeholder: it prints 'not built' (no number) until its issue builds it.

To add a row: append a Goal to GOALS (and, when it needs new work, a Measure to bench/goals.py's
MEASURES, which it runs in the order given, skipping what its budget cannot hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Measure:
    name: str
    budget_s: float  # expected seconds on an H100 / H200 at the full size (what the run plans with)
    needs_cuda: bool
    run: Callable[[object], dict]  # ctx -> result (bench/goals.py's Context)


@dataclass(frozen=True)
class Goal:
    issue: int
    row: str
    op: str  # "<=" or ">=": the figure must be at most / at least the target
    target: float | None
    measure: str | None = None  # a Measure's name; None: not built yet
    figure: Callable[[dict], float | None] | None = None
    goal_text: str | None = None  # shown instead of "op target" (a bound that is not one number)
    scenario: str | None = None  # the workload scenario (SCENARIOS key) the figure reads

    @property
    def goal(self) -> str:
        return self.goal_text or f"{self.op} {self.target:.2f}x"

    def met(self, value: float) -> bool:
        return value <= self.target if self.op == "<=" else value >= self.target


def _step(key: str, field: str = "ms", over: str | None = "base") -> Callable[[dict], float | None]:
    """A decode case's `field`, or its time over another case's."""

    def pick(result: dict) -> float | None:
        row = result.get(key)
        if row is None:
            return None
        if over is None:
            return row.get(field)
        base = result.get(over)
        return row["ms"] / base["ms"] if base else None

    return pick


def _workload(scenario: str, ratio: str) -> Callable[[dict], float | None]:
    """A workload scenario's ratio to the base model of the same run (workload_report.py's `vs_base`)."""

    def pick(result: dict) -> float | None:
        return result.get(scenario, {}).get("vs_base", {}).get(ratio)

    return pick


# The open-loop workload's scenarios (issue 57): key -> (full-size scenario, tiny scenario). The tiny
# ones keep each scenario's shape (more adapters than slots, hottest S) at an eighth of the adapters.
SCENARIOS = {
    "base": ("base", "base"),
    "64/16": ("zipf:64:pool=16", "zipf:8:pool=2"),
    "256/32": ("zipf:256:pool=32", "zipf:32:pool=4"),
    "1024": ("zipf:1024:hot=64", "zipf:128:hot=8"),
    "64": ("zipf:64", "zipf:8"),
    "256": ("zipf:256", "zipf:32"),
}


def _scenario_rows(key: str, label: str, tok: float, p99: float | None, hot: float | None) -> list[Goal]:
    rows = [
        Goal(
            57, f"{label}: tok/s vs base", ">=", tok, "workload", _workload(key, "output_tok_s"), scenario=key
        ),
    ]
    if p99 is not None:
        rows.append(
            Goal(
                57,
                f"{label}: TTFT p99 vs base",
                "<=",
                p99,
                "workload",
                _workload(key, "ttft_ms_p99"),
                scenario=key,
            )
        )
    if hot is not None:
        rows.append(
            Goal(
                57,
                f"{label}: hottest-S TTFT p99 vs base",
                "<=",
                hot,
                "workload",
                _workload(key, "hot_ttft_ms_p99"),
                scenario=key,
            )
        )
    return rows


def _spec(case: str) -> Callable[[dict], float | None]:
    """A speculation case's inter-token latency with speculation on over off."""
    return lambda r: r.get(case, {}).get("itl_on_vs_off")


def _spec_vs_base(batch: int) -> Callable[[dict], float | None]:
    """The 8-adapter batch's on/off latency ratio over the base model's at the same batch."""

    def pick(r: dict) -> float | None:
        lora, base = _spec(f"lora_{batch}")(r), _spec(f"base_{batch}")(r)
        return lora / base if lora and base else None

    return pick


def not_built(issue: int, row: str, goal_text: str) -> Goal:
    return Goal(issue, row, "", None, goal_text=goal_text)


GOALS: list[Goal] = [
    Goal(54, "FP8 decode step vs bf16", "<=", 0.72, "decode", _step("fp8")),
    Goal(54, "FP8 weights + FP8 KV step vs bf16", "<=", 0.60, "decode", _step("fp8_kv8")),
    Goal(54, "bf16 decode step vs its memory floor", "<=", 1.15, "decode", _step("base", "x_floor", None)),
    Goal(
        54,
        "LoRA per layer, 64 tokens x 8 adapters r16, vs floor",
        "<=",
        2.5,
        "lora_layer",
        lambda r: r.get("x_floor"),
    ),
    *_scenario_rows("64/16", "64 Zipf, --max-gpu-loras 16 (S=16)", 0.97, 5.0, 2.0),
    *_scenario_rows("256/32", "256 Zipf, --max-gpu-loras 32 (S=32)", 0.95, 5.0, 2.0),
    *_scenario_rows("1024", "1,024 Zipf, default flags (S=64)", 0.95, 3.0, 1.5),
    # "no worse than today" (issue 57, 2026-12-07 on an H100): 1.00x tok/s, TTFT p99 1.08x / 1.21x
    *_scenario_rows("64", "64 Zipf, default flags", 1.00, 1.08, None),
    *_scenario_rows("256", "256 Zipf, default flags", 1.00, 1.21, None),
    Goal(
        56,
        "decode step, 8 adapters (2 DoRA, 2 embedding/lm_head LoRA) vs 8 plain",
        ">=",
        0.95,
        "adapter_kinds",
        lambda r: r.get("mixed_vs_plain"),
    ),
    *[
        Goal(
            58,
            f"speculation on/off, inter-token latency, batch {b}",
            "<=",
            t,
            "speculation",
            _spec(f"base_{b}"),
        )
        for b, t in ((1, 0.45), (8, 0.60), (32, 0.85))
    ],
    *[
        Goal(
            58,
            f"the same with 8 distinct adapters, batch {b}: ratio over the base model's",
            "<=",
            1.10,
            "speculation",
            _spec_vs_base(b),
        )
        for b in (1, 8, 32)
    ],
    Goal(
        58,
        "speculation on/off, batch 64 throughput",
        ">=",
        0.97,
        "speculation",
        lambda r: r.get("base_64", {}).get("tok_s_on_vs_off"),
    ),
]
