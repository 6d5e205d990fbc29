"""`loraplex.kernels.settings`: the kernels' environment variables, read in one typed place."""

from __future__ import annotations

import json
import os

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
                "LORAPLEX_LORA_FUSED": before.lora_fused,
            }
        )
        lora_configs.clear_caches()
    assert kernel_settings() == before


def test_base_step_options_are_on_for_cuda_unless_switched_and_cublaslt_is_the_default():
    import pytest

    from loraplex.kernels.settings import switched_on

    auto = KernelSettings.from_env({})
    assert (auto.skinny_silu, auto.fused_kv_store, auto.decode_direct) == (None, None, None)
    assert auto.skinny_gemm is False
    assert switched_on(auto.decode_direct, on_cuda=True)
    assert not switched_on(auto.decode_direct, on_cuda=False)
    forced = KernelSettings.from_env({"LORAPLEX_FUSED_KV_STORE": "1", "LORAPLEX_DECODE_DIRECT": "0"})
    assert switched_on(forced.fused_kv_store, on_cuda=False)  # "1": the interpreter too (tests)
    assert not switched_on(forced.decode_direct, on_cuda=True)
    assert auto.blas == "cublaslt" and KernelSettings.from_env({"LORAPLEX_BLAS": "cublas"}).blas == "cublas"
    with pytest.raises(ValueError, match="LORAPLEX_SKINNY_SILU"):
        KernelSettings.from_env({"LORAPLEX_SKINNY_SILU": "yes"})
    with pytest.raises(ValueError, match="LORAPLEX_BLAS"):
        KernelSettings.from_env({"LORAPLEX_BLAS": "rocblas"})


def test_lora_pdl_is_on_unless_switched_off_and_never_on_cpu_tensors():
    import torch

    from loraplex.kernels.placement import pdl_launch

    assert KernelSettings.from_env({}).lora_pdl is None
    assert KernelSettings.from_env({"LORAPLEX_LORA_PDL": "0"}).lora_pdl is False
    assert not pdl_launch(torch.zeros(1))  # the interpreter has no grid dependency control


def test_fp8_pdl_is_off_unless_switched_on_and_never_on_cpu_tensors():
    import pytest
    import torch

    from loraplex.kernels.placement import fp8_pdl_launch

    assert KernelSettings.from_env({}).fp8_pdl is None
    assert KernelSettings.from_env({"LORAPLEX_FP8_PDL": "0"}).fp8_pdl is False
    assert KernelSettings.from_env({"LORAPLEX_FP8_PDL": "1"}).fp8_pdl is True
    with pytest.raises(ValueError, match="LORAPLEX_FP8_PDL"):
        KernelSettings.from_env({"LORAPLEX_FP8_PDL": "on"})
    assert not fp8_pdl_launch(torch.zeros(1))
    reload_kernel_settings({**os.environ, "LORAPLEX_FP8_PDL": "1"})
    try:
        assert not fp8_pdl_launch(torch.zeros(1))  # switched on, still never the interpreter
    finally:
        reload_kernel_settings(os.environ)


def test_fp8_fused_quantization_is_on_for_cuda_and_pdl_off_unless_set():
    from loraplex.kernels.settings import switched_on

    auto = KernelSettings.from_env({})
    assert auto.fp8_fused_quant is None and auto.fp8_pdl is None
    assert switched_on(auto.fp8_fused_quant, on_cuda=True) and not switched_on(
        auto.fp8_fused_quant, on_cuda=False
    )
    off = KernelSettings.from_env({"LORAPLEX_FP8_FUSED_QUANT": "0", "LORAPLEX_FP8_PDL": "1"})
    assert not switched_on(off.fp8_fused_quant, on_cuda=True) and off.fp8_pdl is True
