"""bench/workload.py end to end on the CPU, run the one way every bench runs
(`python -m loraplex.bench.workload` from the repo root): a small open-loop run over the tiny random model.

Only completion is asserted (every request of every scenario finishes without error, none cut);
speed is the benchmark's to report, never a test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run_completes_every_request(tmp_path):
    args = ["--mode", "cpu", "--rate", "15", "--window", "2", "--drain", "30"]
    args += ["--prompt-len", "8,24", "--output-len", "4,12", "--scenarios", "base", "zipf:6", "zipf:6:2"]
    args += ["--workdir", str(tmp_path / "files"), "--out", str(tmp_path)]
    # One torch thread: on a shared 2-core machine two threads fighting for the cores are much slower.
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.bench.workload", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| scenario |" in proc.stdout  # the table
    scenarios = json.loads((tmp_path / "workload.json").read_text())["scenarios"]
    assert list(scenarios) == ["base", "zipf:6", "zipf:6:2"]
    for name, res in scenarios.items():
        assert res["requests"] > 0, name
        assert (res["completed"], res["errors"], res["cut"]) == (res["requests"], 0, 0), (name, res)
    assert scenarios["zipf:6:2"]["setup"]["pool_slots"] == 2
