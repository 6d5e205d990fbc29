"""The LoRA Triton kernels compile for an sm_90 GPU (the interpreter-run tests never invoke the compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loraplex.kernels.compile_check import KERNELS

REPO = Path(__file__).resolve().parents[2]


def test_lora_kernels_compile_for_sm90(tmp_path):
    # A child without TRITON_INTERPRET (kernels decorated under it would not compile) and a fresh cache.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(REPO), "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "loraplex.kernels.compile_check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = {line.split(":")[0] for line in proc.stdout.splitlines() if "cubin" in line}
    assert compiled == set(KERNELS)
