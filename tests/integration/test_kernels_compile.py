"""The LoRA Triton kernels compile for an sm_90 GPU (the interpreter-run tests never invoke the compiler)."""

from __future__ import annotations

from loraplex.kernels.compile_check import KERNELS
from tests.support.child import child_env, run_child


def test_lora_kernels_compile_for_sm90(tmp_path):
    # A child without TRITON_INTERPRET (kernels decorated under it would not compile) and a fresh cache.
    env = child_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    proc = run_child(["-m", "loraplex.kernels.compile_check"], env=env)
    compiled = {line.split(":")[0] for line in proc.stdout.splitlines() if "cubin" in line}
    assert compiled == set(KERNELS)
