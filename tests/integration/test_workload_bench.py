"""bench/workload.py end to end on the CPU: a small open-loop run over the tiny random model.

Only completion is asserted (every request of every scenario finishes without error, none cut);
speed is the benchmark's to report, never a test's."""

from __future__ import annotations

import json

from bench import workload


def test_cpu_smoke_run_completes_every_request(tmp_path, one_torch_thread):
    out = tmp_path / "workload.json"
    rc = workload.main(
        [
            "--mode",
            "cpu",
            "--rate",
            "15",
            "--window",
            "2",
            "--drain",
            "30",
            "--prompt-len",
            "8,24",
            "--output-len",
            "4,12",
            "--scenarios",
            "base",
            "zipf:6",
            "zipf:6:2",
            "--workdir",
            str(tmp_path / "files"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    scenarios = json.loads(out.read_text())["scenarios"]
    assert list(scenarios) == ["base", "zipf:6", "zipf:6:2"]
    for name, res in scenarios.items():
        assert res["requests"] > 0, name
        assert (res["completed"], res["errors"], res["cut"]) == (res["requests"], 0, 0), (name, res)
    assert scenarios["zipf:6:2"]["setup"]["pool_slots"] == 2
