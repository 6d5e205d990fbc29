"""`loraplex.kernels.settings`: the kernels' environment variables, read in one typed place."""

from __future__ import annotations

import json

from loraplex.kernels import lora_configs
from loraplex.kernels.settings import KernelSettings, kernel_settings, reload_kernel_settings


def test_settings_parse_the_environment():
    assert KernelSettings.from_env({}) == KernelSettings(lora_configs=None, triton_interpret=False)
    parsed = KernelSettings.from_env({"LORAPLEX_LORA_CONFIGS": "/x.json", "TRITON_INTERPRET": "1"})
    assert parsed == KernelSettings(lora_configs="/x.json", triton_interpret=True)
    assert KernelSettings.from_env({"LORAPLEX_LORA_CONFIGS": "", "TRITON_INTERPRET": "0"}) == KernelSettings()


def test_reload_reads_an_explicit_mapping_and_applies_the_overrides(tmp_path, monkeypatch):
    key = lora_configs.SplitsKey("decode", in_features=4096)
    monkeypatch.setitem(lora_configs.SPLITS_TABLE, key, lora_configs.SPLITS_TABLE[key])
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"splits": {"decode|4096": 5}}))
    before = kernel_settings()
    try:
        assert reload_kernel_settings({"LORAPLEX_LORA_CONFIGS": str(path)}).lora_configs == str(path)
        assert kernel_settings().lora_configs == str(path)
        lora_configs.apply_settings()
        assert lora_configs.shrink_splits(4096, 64) == 5
    finally:
        interpret = "1" if before.triton_interpret else "0"
        reload_kernel_settings(
            {
                "LORAPLEX_LORA_CONFIGS": before.lora_configs or "",
                "TRITON_INTERPRET": interpret,
            }
        )
        lora_configs.clear_caches()
    assert kernel_settings() == before


def test_overrides_file_with_an_unknown_table_is_refused(tmp_path):
    import pytest

    path = tmp_path / "configs.json"
    for table in ("fused", "shrnk"):  # a removed kernel's table, a typo: refused, not ignored
        path.write_text(json.dumps({"splits": {"decode|4096": 5}, table: {}}))
        with pytest.raises(ValueError, match=f"unknown tables \\['{table}'\\]"):
            lora_configs.load_overrides(str(path))
    lora_configs.clear_caches()


# Every LORAPLEX_* variable the code reads: each is an operator setting documented in
# docs/operations.md. A variable that only picked a kernel variant was removed with its losing branch
# (issue 54; docs/benchmarks.md, "Facts behind defaults"): one measured path per job, no switch.
OPERATOR_SETTINGS = {
    "LORAPLEX_ADMIN_TOKEN",
    "LORAPLEX_API_TOKEN",
    "LORAPLEX_CACHE",
    "LORAPLEX_FP8_GEMM",
    "LORAPLEX_FP8_GEMM_CONFIGS",
    "LORAPLEX_LORA_CONFIGS",
    "LORAPLEX_ROUTER_LISTEN",
    "LORAPLEX_STORE",
    "LORAPLEX_STORE_TOKEN",
    "LORAPLEX_TARGET",
    "LORAPLEX_TLS_CA",
    "LORAPLEX_TLS_CERT",
    "LORAPLEX_TLS_KEY",
    "LORAPLEX_TOKEN",
}


def test_no_variable_picks_a_kernel_variant_and_each_setting_is_documented():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def read(folders: tuple[str, ...]) -> set[str]:
        paths = [path for folder in folders for path in (root / folder).rglob("*.py")]
        return {name for path in paths for name in re.findall(r"LORAPLEX_[A-Z0-9_]+", path.read_text())}

    names = read(("kernels", "services", "clients", "adapter_store"))
    assert names <= OPERATOR_SETTINGS, sorted(names - OPERATOR_SETTINGS)
    kernel_names = read(("kernels",))
    assert kernel_names == {"LORAPLEX_LORA_CONFIGS", "LORAPLEX_FP8_GEMM", "LORAPLEX_FP8_GEMM_CONFIGS"}
    operations = (root / "docs" / "operations.md").read_text()
    assert all(f"`{name}=" in operations for name in kernel_names)
    assert set(KernelSettings.__dataclass_fields__) == {
        "lora_configs",
        "triton_interpret",
        "fp8_gemm",
        "fp8_gemm_configs",
    }


def test_lora_pdl_never_on_cpu_tensors():
    import torch

    from loraplex.kernels.placement import pdl_launch

    assert not pdl_launch(torch.zeros(1))  # the interpreter has no grid dependency control
