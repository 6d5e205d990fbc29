"""Every benchmark suite end to end on the CPU at its tiny size, run the one way users run them
(`python -m loraplex.bench.NAME` from the repo root): the serving suite's open-loop workload
(bench/workload.py), step, quality, door, kernels (which says it needs CUDA, but for its upload part)
and the goals command, whose table and JSON are exercised for real (rows that need CUDA say so).

The workload's first test asserts completion only (every request of every scenario finishes without
error, none cut). The second is the CPU smoke version of issue 34's first goal row (64 Zipf adapters
on `--max-loras-per-batch 8`): ratios to the base model in the same run, with bounds loose enough for
a shared CI machine, so a policy that starves hot or cold adapters, or collapses throughput, fails.
The GPU versions: tests/integration/test_gpu_bench_smoke.py."""

from __future__ import annotations

import json

from loraplex.bench.goal_table import GOALS
from tests.support.child import child_env, run_child


def run_bench(name: str, tmp_path, args: list[str]):
    """(stdout, the JSON it wrote) of `python -m loraplex.bench.NAME ARGS --out tmp_path`."""
    # One torch thread: on a shared 2-core machine two threads fighting for the cores are much slower.
    env = child_env(OMP_NUM_THREADS="1")
    proc = run_child(["-m", f"loraplex.bench.{name}", *args, "--out", str(tmp_path)], env=env, timeout=600)
    return proc.stdout, json.loads((tmp_path / f"{name}.json").read_text())


def run_workload(tmp_path, args: list[str]) -> dict:
    out, result = run_bench("workload", tmp_path, [*args, "--workdir", str(tmp_path / "files")])
    assert "| scenario |" in out  # the table
    return result["scenarios"]


def test_cpu_smoke_of_the_scarce_slot_goal_row(tmp_path):
    """64 Zipf adapters on 8 distinct per step against the base model: ratios only, loose bounds."""
    args = ["--mode", "cpu", "--rate", "30", "--window", "6", "--drain", "30", "--output-len", "16,48"]
    scenarios = run_workload(tmp_path, [*args, "--scenarios", "base", "zipf:64:8"])
    capped = scenarios["zipf:64:8"]
    assert (capped["completed"], capped["cut"]) == (capped["requests"], 0), capped
    assert capped["setup"]["pool_slots"] == 64 and capped["setup"]["max_loras_per_batch"] == 8
    assert capped["uploads"] <= 64 and capped["evictions"] == 0  # left out of steps, never evicted
    vs = capped["vs_base"]
    # Tokens inside a 6 s window: cold requests decode in a share of steps, so more of their tokens
    # land after it than the base model's (0.84x over 60 s on the H200 model; docs/benchmarks.md,
    # "Scarce slots"); the drain-rule collapse this guards against was 0.30x.
    assert vs["output_tok_s"] >= 0.4, vs
    assert vs["hot_ttft_ms_p99"] <= 25, vs  # the 8 hottest (the issue's goal on the H200: 2x)
    assert vs["other_ttft_ms_p99"] <= 50, vs  # the other 56 (goal on the H200: 15x)
    assert len(capped["queue_ms_by_decile"]) == 10


def test_cpu_smoke_run_completes_every_request(tmp_path):
    args = ["--mode", "cpu", "--rate", "15", "--window", "2", "--drain", "30"]
    args += ["--prompt-len", "8,24", "--output-len", "4,12", "--scenarios", "base", "zipf:6", "zipf:6:2"]
    args += ["zipf:6:pool=2"]
    scenarios = run_workload(tmp_path, args)
    assert list(scenarios) == ["base", "zipf:6", "zipf:6:2", "zipf:6:pool=2"]
    for name, res in scenarios.items():
        assert res["requests"] > 0, name
        assert (res["completed"], res["errors"], res["cut"]) == (res["requests"], 0, 0), (name, res)
    # the per-batch cap never sizes the pool; --max-gpu-loras does
    assert scenarios["zipf:6:2"]["setup"]["max_loras_per_batch"] == 2
    assert scenarios["zipf:6:2"]["setup"]["pool_slots"] == scenarios["zipf:6"]["setup"]["pool_slots"] > 2
    assert scenarios["zipf:6:pool=2"]["setup"]["pool_slots"] == 2


def test_step_suite_times_every_part_at_the_tiny_size(tmp_path):
    out, result = run_bench("step", tmp_path, ["--tiny", "--device", "cpu", "--repeats", "2"])
    decode = result["decode"]
    assert list(decode) == ["base", "fp8", "fp8_kv8", "kv8", "base_lora", "fp8_lora"]
    assert all(r["ms"] > 0 and r["floor_ms"] is None for r in decode.values())  # no bandwidth on the CPU
    assert decode["fp8"]["weight_gb"] < decode["base"]["weight_gb"]  # FP8 weights are stored smaller
    assert decode["fp8_kv8"]["kv_gb"] == decode["base"]["kv_gb"] / 4  # an FP8 cache vs float32
    assert decode["base_lora"]["read_gb"] > decode["base"]["read_gb"]  # the adapters' A/B are read
    assert [r["model"] for r in result["families"]] == ["tiny-qwen3", "tiny-gemma2"]
    assert [r["model"] for r in result["moe"]] == ["tiny-qwen3_moe", "tiny-mixtral"]
    assert len(result["prefill"]) == 2 and "| case | ms |" in out


def test_kernels_suite_says_it_needs_cuda(tmp_path):
    out, result = run_bench("kernels", tmp_path, ["--device", "cpu"])
    assert result["skipped"] == "needs CUDA" and "needs CUDA" in out


def test_kernels_upload_part_runs_on_the_cpu(tmp_path):
    # the one part that runs without CUDA: both host layouts at ranks 16 and 64, the same bytes moved
    out, result = run_bench("kernels", tmp_path, ["--device", "cpu", "--parts", "upload", "--tiny"])
    rows = result["upload"]
    assert [(r["rank"], r["layout"]) for r in rows] == [
        (16, "per module"),
        (16, "packed"),
        (64, "per module"),
        (64, "packed"),
    ]
    assert rows[0]["mb"] == rows[1]["mb"] and rows[2]["mb"] == 4 * rows[0]["mb"]
    assert "| rank | host layout |" in out


def test_fp8_gemm_tuner_checks_its_kernels_under_the_interpreter(tmp_path):
    env = child_env(interpret=True, OMP_NUM_THREADS="1")
    args = ["-m", "loraplex.bench.fp8_gemm", "--tiny", "--rows", "1,16", "--out", str(tmp_path)]
    out = run_child(args, env=env, timeout=600).stdout
    assert "checks passed (CPU: no timing)" in out and "FAIL" not in out
    assert out.count(" ok\n") == 2 * 2 * 4 * 2  # kernels x rows x projections x scale kinds


def test_quality_suite_compares_fp8_with_bf16(tmp_path):
    _, result = run_bench("quality", tmp_path, ["--positions", "32", "--only", "served"])
    served = next(r for r in result["rows"] if r["variant"] == "fp8 per-channel, served")
    assert served["reference"] == "bf16" and 0.5 < served["top1_agreement"] <= 1


def test_door_suite_times_both_paths(tmp_path):
    out, result = run_bench("door", tmp_path, ["--requests", "2", "--warmup", "1"])
    assert "door overhead" in out and result["requests"] == 2


def test_goals_runs_chosen_workload_scenarios_with_server_flags(tmp_path):
    """--scenarios picks rows; --server-arg reaches every scenario's engine (here: one KV/LoRA budget)."""
    args = ["--tiny", "--device", "cpu", "--workdir", str(tmp_path / "files"), "--measures", "workload"]
    args += ["--scenarios", "base,64/16", "--server-arg", "lora_memory=unified"]
    out, result = run_bench("goals", tmp_path, args)
    scenarios = result["measures"]["workload"]["result"]
    assert set(scenarios) == {"base", "64/16"}
    for name, res in scenarios.items():
        assert (res["completed"], res["errors"]) == (res["requests"], 0), (name, res)
        assert res["setup"]["block_manager"] == "UnifiedBlocks", res["setup"]
    rows = {r["row"]: r for r in result["rows"] if r["measure"] == "workload"}
    assert all(r["status"] in ("met", "missed") for k, r in rows.items() if k.startswith("64 Zipf, --max"))
    assert rows["256 Zipf, default flags: tok/s vs base"]["status"] == "not run (budget or --scenarios)"
    assert result["workload"]["server_args"] == ["lora_memory=unified"]


def test_goals_command_prints_and_writes_every_row(tmp_path):
    args = ["--tiny", "--device", "cpu", "--workdir", str(tmp_path / "files")]
    out, result = run_bench("goals", tmp_path, args)
    rows = result["rows"]
    assert [(r["issue"], r["row"]) for r in rows] == [(g.issue, g.row) for g in GOALS]
    by_status = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(r)
        assert f"| {r['issue']} | {r['row']} | {r['goal']} |" in out  # the printed table
    # measured on the CPU: the FP8 step ratios, the adapter kinds' step, speculation and every workload
    # ratio, each judged against its goal
    measured = by_status.get("met", []) + by_status.get("missed", [])
    on_cpu = ("decode", "adapter_kinds", "speculation", "workload")
    assert {r["measure"] for r in measured} == set(on_cpu)
    assert len(measured) == sum(g.measure in on_cpu for g in GOALS) - 1
    assert all(r["value"] > 0 for r in measured)
    assert [r["row"] for r in by_status["needs CUDA"]] == [
        "bf16 decode step vs its memory floor",  # no bandwidth measured on the CPU
        "LoRA per layer, 64 tokens x 8 adapters r16, vs floor",
    ]
    assert "not built" not in by_status
    spec = result["measures"]["speculation"]["result"]
    assert all(spec[case]["drafted"] > 0 for case in ("base_1", "lora_8", "base_32"))
    assert spec["base_64"]["drafted"] == 0  # above --speculative-disable-batch-size it backs off
    scenarios = result["measures"]["workload"]["result"]
    assert set(scenarios) == {"base", "64/16", "256/32", "1024", "64", "256"}
    for name, res in scenarios.items():
        assert (res["completed"], res["errors"]) == (res["requests"], 0), (name, res)
    assert scenarios["1024"]["setup"]["pool_slots"] < 128  # the tiny 1,024 row: 128 adapters, fewer slots
    assert scenarios["1024"]["hot_adapters"] == 8  # zipf:128:hot=8 (the full row's hottest 64)
    # adapters past the 64 written share their weights file (a hard link) under a config of their own
    adapters = tmp_path / "files" / "adapters-r8"
    linked, own = adapters / "adapter100", adapters / f"adapter{100 % 64:02d}"
    assert (linked / "adapter_model.safetensors").stat().st_ino == (
        own / "adapter_model.safetensors"
    ).stat().st_ino
    alphas = [json.loads((d / "adapter_config.json").read_text())["lora_alpha"] for d in (own, linked)]
    assert alphas[1] == alphas[0] + 1
