"""Nothing compiles while serving: after the engine's start-up warm-up, varied steps launch no Triton
specialisation key the warm-up did not (each new key would be a compile on the engine thread).

The kernels run on the CPU under Triton's interpreter in a child process (the variable is read
when the kernels are decorated); the keys are Triton's own (kernels/compile_watch.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_varied_steps_after_warm_up_compile_nothing():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "compile_after_warmup_check.py")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["served_keys"] > 10, result  # the steps did launch the step kernels
    assert result["new_after_warmup"] == [], result
    # A step outside the warm-up's range does show up as new keys: the check can see a new shape class.
    assert "lora_meta._segments_kernel" in result["control_new"], result
