"""`--kv-cache-dtype fp8` (E4M3 with per-layer scales) on the CUDA path's Triton kernels.

The kernels themselves (store bytes, decode and prefill over an FP8 cache) are checked against
their torch references in tests/integration/test_attention_kernels.py. Here: the engine serves the
same greedy tokens over an FP8 cache on the Triton path (under TRITON_INTERPRET=1, in a child
process: Triton reads the variable at import) as on the torch path, through mixed steps and
prefix-cache hits; the capacity gain is logged; calibrated scales load in place; a checkpoint's
own KV cache scales are refused in one line.
"""

from __future__ import annotations

import logging

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.kv_cache import KVCacheScales, plan_num_blocks
from loraplex.services.inference.models.config import UnsupportedModelError, parse_config
from loraplex.services.inference.models.quantization.scheme import resolve_scheme
from tests.support.child import child_env, run_child


def test_triton_fp8_kv_engine_gives_the_torch_fp8_tokens(tiny_llama_path):
    argv = ["-m", "tests.support.fp8_kv_engine_check", str(tiny_llama_path)]
    proc = run_child(argv, env=child_env(interpret=True))
    assert proc.stdout.rstrip().endswith("ok"), proc.stdout


def test_fp8_kv_kernels_compile_for_sm90(tmp_path):
    # A child without TRITON_INTERPRET (kernels decorated under it would not compile) and a fresh cache.
    env = child_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    proc = run_child(["-m", "tests.support.fp8_kv_compile_check"], env=env)
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": ptx" in line)
    assert set(lines) == {"store_kv_fp8", "qkv_rotary_store_fp8", "decode_fp8", "prefill_fp8_softcap"}, (
        proc.stdout
    )
    assert "div 0," in lines["store_kv_fp8"]  # a division would not be correctly rounded: not bit-exact
    assert "e4m3 cvt 0" not in lines["decode_fp8"] and "e4m3 cvt 0" not in lines["prefill_fp8_softcap"]


def test_fp8_cache_is_accepted_on_cuda():
    config = EngineConfig(model_path="m", device=torch.device("cuda"), kv_cache_dtype="fp8")
    assert config.kv_dtype(torch.bfloat16) == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "activations, gain",
    [(torch.bfloat16, "2.0x the blocks of bf16"), (torch.float32, "4.0x the blocks of fp32")],
)
def test_capacity_gain_is_logged_in_blocks(caplog, activations, gain):
    cfg = parse_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "vocab_size": 128,
            "max_position_embeddings": 1 << 20,
        }
    )
    with caplog.at_level(logging.INFO, logger="loraplex.services.inference.engine.kv_cache"):
        blocks = plan_num_blocks(
            cfg,
            torch.float8_e4m3fn,
            torch.device("cpu"),
            page_size=16,
            context_length=1 << 20,
            max_running_requests=1 << 10,  # the CPU's memory cap binds, not the requests
            max_total_tokens=None,
            mem_fraction_static=0.9,
            activation_dtype=activations,
        )
    assert f"KV cache fp8: {gain} ({blocks} blocks" in caplog.text, caplog.text


def test_calibrated_scales_load_in_place():
    scales = KVCacheScales(3, torch.device("cpu"))
    assert torch.equal(scales.scale, torch.ones(3, 2))  # the default: unit scales
    k_scale, v_scale, k_inv, v_inv = scales.layers[1]
    scales.load_(torch.tensor([[1.0, 1.0], [0.5, 4.0], [2.0, 0.25]]))
    # the per-layer views the kernels were given (and a captured graph holds) see the new values
    assert (k_scale.item(), v_scale.item(), k_inv.item(), v_inv.item()) == (0.5, 4.0, 2.0, 0.25)
    for bad in (torch.ones(2, 2), torch.tensor([[1.0, 0.0]] * 3), torch.tensor([[1.0, float("nan")]] * 3)):
        with pytest.raises(ValueError, match="positive and finite"):
            scales.load_(bad)


def test_checkpoint_kv_cache_scales_are_refused_in_one_line():
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            }
        },
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    with pytest.raises(UnsupportedModelError) as info:
        resolve_scheme(None, qc)
    message = str(info.value)
    assert "\n" not in message and "kv_cache_scheme" in message and "--kv-cache-dtype fp8" in message
