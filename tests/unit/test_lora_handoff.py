"""The one-launch LoRA shrink + expand (kernels/lora_handoff.py): bit for bit the two-kernel path under
Triton's interpreter and within tolerance of the torch references, counters left zero, equal greedy
tokens and logits through the engine with LORAPLEX_LORA_HANDOFF on (child process,
tests/support/lora_handoff_check.py), and which launches the plan hands off."""

from __future__ import annotations

import pytest

from loraplex.kernels.lora_configs import DECODE_MAX_TOKENS, MANY_ADAPTERS
from loraplex.kernels.lora_plan import GroupShape, handoff_fits, plan_group, plan_step
from loraplex.kernels.settings import KernelSettings
from tests.support.child import child_env, json_lines, run_child

SHAPES = {
    "qkv": GroupShape(4096, (4096, 1024, 1024), 16),
    "o": GroupShape(4096, (4096,), 16),
    "gate_up": GroupShape(4096, (14336, 14336), 16),
    "down": GroupShape(14336, (4096,), 16),
}


def test_handoff_matches_two_kernels_and_engine_tokens_match():
    # the child sets each backend's mode itself
    env = child_env(interpret=True, LORAPLEX_LORA_FUSED="off", LORAPLEX_LORA_HANDOFF="0")
    proc = run_child(["-m", "tests.support.lora_handoff_check"], env=env)
    cases = json_lines(proc.stdout)
    assert len(cases) >= 12 and all(c["ok"] for c in cases), cases
    assert max(c["num_slots"] for c in cases) == 256 and min(c["num_slots"] for c in cases) == 1
    assert any(c["per_token"] for c in cases) and any(not c["per_token"] for c in cases)
    assert any(c["splits"] > 1 for c in cases)
    assert any(c["delta_norm"] > 0 for c in cases) and any(c["delta_norm"] == 0 for c in cases)
    engine = [line for line in proc.stdout.splitlines() if line.startswith("engine")]
    assert len(engine) == 2 and all(line.endswith(" ok") for line in engine), engine


@pytest.mark.parametrize("distinct", [8, MANY_ADAPTERS + 1, 64])
def test_decode_steps_hand_off_every_group(distinct):
    plan = plan_step(SHAPES, 64, num_slots=64, max_distinct=distinct, handoff=True)
    for name, launch in plan.groups.items():
        assert launch.handoff and handoff_fits(launch), name
        # the same blocks and splits as the two-kernel launch it replaces
        assert launch._replace(handoff=False) == plan_group(
            SHAPES[name], 64, launch.distinct_bound, plan.many_adapters
        )


def test_handoff_stays_off_for_prefill_fused_and_by_default():
    assert not any(g.handoff for g in plan_step(SHAPES, 64, 64, 64).groups.values())
    prefill = plan_step(SHAPES, DECODE_MAX_TOKENS + 1, 64, 64, handoff=True)
    assert not any(g.handoff for g in prefill.groups.values())
    fused = plan_step(SHAPES, 64, 64, 8, fused="on", handoff=True)
    assert all(g.fused is not None and not g.handoff for g in fused.groups.values())
    # block sizes that differ between shrink and expand cannot share one counter per token block
    launch = plan_group(SHAPES["o"], 64, 8)
    odd = launch._replace(expand=launch.expand._replace(block_m=launch.shrink.block_m * 2, per_token=0))
    assert not handoff_fits(odd)


def test_setting_parses():
    assert KernelSettings.from_env({}).lora_handoff is None
    assert KernelSettings.from_env({"LORAPLEX_LORA_HANDOFF": "1"}).lora_handoff is True
    assert KernelSettings.from_env({"LORAPLEX_LORA_HANDOFF": "0"}).lora_handoff is False
    with pytest.raises(ValueError, match="LORAPLEX_LORA_HANDOFF"):
        KernelSettings.from_env({"LORAPLEX_LORA_HANDOFF": "yes"})
