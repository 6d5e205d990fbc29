"""The fused LoRA shrink->expand (kernels/lora_fused.py): exact against its torch reference under
Triton's interpreter (child process, tests/support/lora_fused_check.py), equal greedy tokens through
the engine with LORAPLEX_LORA_FUSED=on, and the setting's choice of launches."""

from __future__ import annotations

import json

import pytest

from loraplex.kernels import lora_configs
from loraplex.kernels.lora_configs import FusedConfig, FusedKey, fused_config
from loraplex.kernels.lora_plan import GroupShape, plan_step
from loraplex.kernels.settings import KernelSettings
from tests.support.child import REPO, child_env, json_lines, run_child


def test_fused_kernel_matches_reference_and_engine_tokens_match_unfused():
    env = child_env(interpret=True, LORAPLEX_LORA_FUSED="off")  # the child sets each backend's mode itself
    proc = run_child([str(REPO / "tests" / "support" / "lora_fused_check.py")], env=env)
    cases = json_lines(proc.stdout)
    assert len(cases) >= 12 and all(c["ok"] for c in cases), cases
    assert max(c["num_slots"] for c in cases) == 256 and min(c["num_slots"] for c in cases) == 1
    assert any(c["delta_norm"] > 0 for c in cases) and any(c["delta_norm"] == 0 for c in cases)
    engine = [line for line in proc.stdout.splitlines() if line.startswith("engine")]
    assert len(engine) == 2 and all(line.endswith(" ok") for line in engine), engine


ENTRY = FusedConfig(block_m=16, block_k=256, block_n=128, chunk_n=2048, num_warps=4, num_stages=3)
QKV = GroupShape(in_features=4096, widths=(4096, 1024, 1024), max_rank=16)


@pytest.fixture
def one_entry(monkeypatch):
    """FUSED_TABLE with one measured decode entry (qkv, rank bucket 16)."""
    monkeypatch.setattr(lora_configs, "FUSED_TABLE", {FusedKey("decode", 4096, 6144, 3, 16): ENTRY})
    lora_configs.clear_caches()
    yield
    lora_configs.clear_caches()


def test_auto_is_off_without_a_table_entry():
    lora_configs.clear_caches()
    assert lora_configs.FUSED_TABLE == {}  # filled only from measurements
    plan = plan_step({"qkv": QKV}, 64, 8, 8, fused="auto")
    assert plan.groups["qkv"].fused is None
    assert fused_config("off", 4096, 6144, 3, 16, 64) is None


def test_auto_takes_measured_entries_up_to_256_tokens(one_entry):
    assert fused_config("auto", 4096, 6144, 3, 16, 64) == ENTRY
    assert fused_config("auto", 4096, 6144, 3, 8, 256) == ENTRY  # rank 8 falls in bucket 16
    assert fused_config("auto", 4096, 6144, 3, 16, 64, many=True) == ENTRY  # no decode_many: decode's
    assert fused_config("auto", 4096, 6144, 3, 16, 257) is None  # prefill-sized
    assert fused_config("auto", 4096, 4096, 1, 16, 64) is None  # another group: no entry
    assert fused_config("off", 4096, 6144, 3, 16, 64) is None
    plan = plan_step({"qkv": QKV, "o": GroupShape(4096, (4096,), 16)}, 64, 8, 8, fused="auto")
    assert plan.groups["qkv"].fused == ENTRY and plan.groups["o"].fused is None


def test_on_forces_fused_everywhere(one_entry):
    assert fused_config("on", 4096, 6144, 3, 16, 64) == ENTRY
    assert fused_config("on", 4096, 4096, 1, 16, 64) == lora_configs.fused_default_config(64)
    assert fused_config("on", 4096, 6144, 3, 16, 4096) == lora_configs.fused_default_config(4096)


def test_overrides_file_loads_fused_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(lora_configs, "FUSED_TABLE", {})
    path = tmp_path / "lora_fused_configs.json"
    path.write_text(json.dumps({"fused": {"decode_many|14336|4096|1|64": [16, 512, 128, 1024, 8, 3]}}))
    lora_configs.load_overrides(str(path))
    try:
        assert fused_config("auto", 14336, 4096, 1, 64, 64, many=True) == FusedConfig(
            16, 512, 128, 1024, 8, 3
        )
        assert fused_config("auto", 14336, 4096, 1, 64, 64, many=False) is None
    finally:
        lora_configs.clear_caches()


def test_setting_parses_and_refuses_unknown_modes():
    assert KernelSettings.from_env({}).lora_fused == "auto"
    assert KernelSettings.from_env({"LORAPLEX_LORA_FUSED": "ON"}).lora_fused == "on"
    assert KernelSettings.from_env({"LORAPLEX_LORA_FUSED": "off"}).lora_fused == "off"
    with pytest.raises(ValueError, match="LORAPLEX_LORA_FUSED"):
        KernelSettings.from_env({"LORAPLEX_LORA_FUSED": "yes"})
