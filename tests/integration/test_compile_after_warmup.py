"""Nothing compiles while serving: after the engine's start-up warm-up, varied steps launch no Triton
specialisation key the warm-up did not (each new key would be a compile on the engine thread).

The kernels run on the CPU under Triton's interpreter in a child process (the variable is read
when the kernels are decorated); the keys are Triton's own (kernels/compile_watch.py).
"""

from __future__ import annotations

from tests.support.child import REPO, child_env, last_json, run_child


def test_varied_steps_after_warm_up_compile_nothing():
    script = str(REPO / "tests" / "support" / "compile_after_warmup_check.py")
    result = last_json(run_child([script], env=child_env(interpret=True), timeout=600).stdout)
    assert result["served_keys"] > 10, result  # the steps did launch the step kernels
    assert result["new_after_warmup"] == [], result
    # A step outside the warm-up's range does show up as new keys: the check can see a new shape class.
    assert "lora_meta._segments_kernel" in result["control_new"], result
