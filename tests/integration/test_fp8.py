"""FP8 base models: every way in (quantize at load, compressed-tensors float-quantized per channel
and per tensor with static input scales, block-wise fp8) loads and generates exactly what
transformers generates in float32 over the checkpoint's own dequantized weights; adapters over an
FP8 base match PEFT over the dequantized base; every other quantization is refused in one line.

On the CPU the FP8 linears dequantize their weights to the activation dtype (activations are
not quantized), so float32 runs are exact against the dequantized reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.kernels.fp8_matmul import FP8_DTYPE, fp8_linear_mm, fp8_linear_ref, quantize_rows
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.models.config import UnsupportedModelError
from loraplex.services.inference.models.loader import load_model
from loraplex.services.inference.models.quantization.fp8_linear import Fp8Linear
from loraplex.services.inference.models.quantization.scheme import resolve_scheme
from tests.integration.test_engine_correctness import PROMPTS, hf_greedy, make_engine
from tests.support.fp8_checkpoints import FORMATS, dequantize_checkpoint, write_fp8_checkpoint
from tests.support.lora_reference import (
    BATCH,
    NEW_TOKENS,
    make_adapters,
    peft_greedy,
    server_args,
    sync_engine,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def fp8_dirs(tiny_llama_path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """format -> (FP8 checkpoint, its float32 dequantized reference); "load" is the float
    checkpoint served with --quantization fp8."""
    root = tmp_path_factory.mktemp("fp8")
    dirs = {"load": (tiny_llama_path, dequantize_checkpoint(tiny_llama_path, root / "load-ref"))}
    for fmt in FORMATS:
        ckpt = write_fp8_checkpoint(tiny_llama_path, root / fmt, fmt)
        dirs[fmt] = (ckpt, dequantize_checkpoint(ckpt, root / f"{fmt}-ref"))
    return dirs


@pytest.mark.parametrize("fmt", ["load", *FORMATS])
def test_fp8_checkpoint_matches_its_dequantized_reference(fmt, fp8_dirs, tiny_llama_path):
    ckpt, ref = fp8_dirs[fmt]
    engine = make_engine(ckpt, page_size=4, quantization="fp8" if fmt == "load" else None)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * 2 and all(m.weight.dtype == FP8_DTYPE for m in linears)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    expected = hf_greedy(ref, prompts, 24)
    assert [r.token_ids for r in results] == expected
    # FP8 really changed the weights: the unquantized model generates something else somewhere.
    assert expected != hf_greedy(tiny_llama_path, prompts, 24)


def test_fp8_weights_take_a_quarter_of_float32(fp8_dirs):
    ckpt, _ = fp8_dirs["ct-channel"]
    model, _ = load_model(ckpt, torch.device("cpu"), torch.float32)
    float_model, _ = load_model(fp8_dirs["load"][1], torch.device("cpu"), torch.float32)
    q = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Fp8Linear))
    f = sum(getattr(float_model.layers[0], a).weight.nbytes for a in ("qkv_proj", "o_proj", "gate_up_proj"))
    f += float_model.layers[0].down_proj.weight.nbytes
    assert q == f * len(model.layers) // 4


@pytest.mark.parametrize("pieces", [False, True], ids=["plain", "mixed-graph-pieces"])
def test_adapters_over_fp8_base_match_peft_on_dequantized_base(pieces, fp8_dirs, adapter_factory):
    """Mixed adapter batch (more adapters than slots) over an FP8 base, through the plain step and
    the piecewise mixed-step path; then the same prompts again, served from the prefix cache."""
    ckpt, ref = fp8_dirs["ct-channel"]
    # Adapters made for the float model of the same shapes (the store's shape checks pass them).
    adapters = make_adapters(adapter_factory, ref, "fp8-e2e")
    engine = sync_engine(server_args(ckpt, adapters, max_loras_per_batch=2, mixed_graphs=pieces))
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(BATCH)]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), list(BATCH))
    expected = peft_greedy(ref, adapters, list(zip(prompts, BATCH, strict=True)))
    for out, exp, name in zip(outs, expected, BATCH, strict=True):
        assert out.token_ids == exp, f"adapter {name}: engine {out.token_ids} != PEFT {exp}"
    assert len({tuple(e) for e in expected[:5]}) == 5
    if pieces:
        assert engine.runner.mixed_graphs.steps_run > 0
    again = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), list(BATCH))
    assert [o.token_ids for o in again] == expected
    assert sum(engine.stats().prefix_cache_hit_tokens.values()) > 0


def test_quantize_at_load_with_adapters_and_bf16_activations(fp8_dirs, adapter_factory):
    """bfloat16 activations over FP8 weights with adapters: the LoRA delta is computed in bf16 beside
    the base; greedy tokens agree with the float32 dequantized reference on most positions."""
    ckpt, ref = fp8_dirs["load"]
    adapters = make_adapters(adapter_factory, ref, "fp8-bf16")
    engine = sync_engine(
        server_args(ckpt, adapters, max_loras_per_batch=2, quantization="fp8", dtype="bfloat16")
    )
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(BATCH)]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8), list(BATCH))
    expected = peft_greedy(ref, adapters, list(zip(prompts, BATCH, strict=True)), 8)
    first = [o.token_ids[0] == e[0] for o, e in zip(outs, expected, strict=True)]
    assert sum(first) >= len(first) - 1, (outs, expected)


def test_scaled_mm_path_agrees_with_the_reference_within_fp8_tolerance():
    """The GPU path's math (per-token activation quantization + row-wise scaled GEMM) against the
    dequantizing reference; runs wherever torch._scaled_mm does (CPU on recent torch)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 128, generator=gen).to(torch.bfloat16)
    w, scale = quantize_rows(torch.randn(64, 128, generator=gen) * 0.05)
    ref = fp8_linear_ref(x.float(), w, scale, None)
    try:
        out = fp8_linear_mm(x, w, scale.reshape(1, -1).contiguous())
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm does not run here: {exc}")
    # E4M3 activations: 3 mantissa bits, relative error per element <= 2^-4; summed over K it
    # averages out. 5% of the output's scale is the tolerance we state.
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err


@pytest.mark.parametrize(
    "qc, named",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "mystery"}, "mystery"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
            "pack",
        ),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ],
)
def test_other_quantizations_are_refused_in_one_line(qc, named, tiny_llama_path, tmp_path):
    with pytest.raises(UnsupportedModelError) as info:
        resolve_scheme(None, qc)
    message = str(info.value)
    assert "\n" not in message and named in message
    assert "supported: --quantization fp8" in message and "compressed-tensors float-quantized" in message
    # ... and at start, before any weight is read.
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    (model / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="is not supported; supported"):
        make_engine(model)


def test_fp8_weight_without_its_scale_is_refused(fp8_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, _ = fp8_dirs["ct-channel"]
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="FP8 weight without its weight_scale"):
        load_model(bad, torch.device("cpu"), torch.float32)


BAD_SCALES = [
    ("fp8-block", "model.layers.0.self_attn.q_proj.weight_scale_inv", float("inf")),
    ("fp8-block", "model.layers.1.mlp.down_proj.weight_scale_inv", float("nan")),
    ("ct-channel", "model.layers.1.mlp.up_proj.weight_scale", 0.0),
    ("ct-channel", "model.layers.0.self_attn.o_proj.weight_scale", -0.01),
    ("ct-channel", "model.layers.0.self_attn.k_proj.weight_scale", float("nan")),
    ("ct-tensor-static", "model.layers.0.mlp.gate_proj.input_scale", float("inf")),
]


@pytest.mark.parametrize("fmt, name, value", BAD_SCALES, ids=[f"{f}-{v}" for f, _, v in BAD_SCALES])
def test_fp8_scales_that_are_not_finite_and_positive_are_refused(fp8_dirs, tmp_path, fmt, name, value):
    """Issue 59 (M6, L5): an Inf block scale was served as NaN logits, a scale of 0 or below was served,
    a NaN one was refused as a missing scale. Each is now one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(fp8_dirs[fmt][0], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors[name].view(-1)[-1] = value
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(bad, torch.device("cpu"), torch.float32)
    message = str(e.value)
    assert f"{name!r}: FP8 scales must be finite and positive; it holds {value:g}" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor-static", "fp8-block-32"])
def test_fp8_tp2_matches_tp1(fmt, fp8_dirs, tiny_llama_path, adapter_factory, tmp_path):
    """Scales sharded with their weights (per-channel rows with column-parallel rows, whole for
    row-parallel o/down; per-tensor and input scales whole; block scales by block) over gloo."""
    from tests.integration.test_tp import mixed_adapters, mixed_jobs, outputs, tp_args

    if fmt == "fp8-block-32":  # blocks every rank's shard starts on
        ckpt = write_fp8_checkpoint(tiny_llama_path, tmp_path / fmt, "fp8-block", block=(16, 32))
    else:
        ckpt = fp8_dirs[fmt][0]
    adapters = mixed_adapters(adapter_factory, fp8_dirs["load"][1])
    jobs = mixed_jobs()
    want = outputs(tp_args(ckpt, 1, adapters, max_loras_per_batch=2), jobs, 8)
    got = outputs(tp_args(ckpt, 2, adapters, max_loras_per_batch=2), jobs, 8)
    assert got == want
    assert len({tuple(t) for t in want}) > 3


def test_block_fp8_whose_blocks_straddle_a_tp_shard_is_refused(fp8_dirs):
    from loraplex.services.inference.models.config import load_config
    from loraplex.services.inference.parallel.model import load_tp_model
    from loraplex.services.inference.parallel.partition import plan_shards

    ckpt, _ = fp8_dirs["fp8-block"]  # 48-column blocks; down_proj's input splits at column 64
    plan = plan_shards(load_config(ckpt), 2)[1]
    with pytest.raises(UnsupportedModelError, match=r"block-wise FP8 \(16x48\) under --tp-size 2"):
        load_tp_model(ckpt, plan, torch.device("cpu"), torch.float32)


def test_the_store_sees_the_same_shapes_in_an_fp8_checkpoint(fp8_dirs):
    """The adapter store validates an adapter against its base's config.json shapes: an FP8
    checkpoint's are the float model's, so adapters for one serve the other."""
    from loraplex.adapter_store.base_model import load_base_model_shapes

    for fmt in FORMATS:
        ckpt, ref = fp8_dirs[fmt]
        assert load_base_model_shapes(str(ckpt)).linears == load_base_model_shapes(str(ref)).linears


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_operands_prepared_at_load_compute_the_same_linear(fmt, fp8_dirs):
    """What `finish(fast=True)` readies for the CUDA GEMM (block scales re-quantized per channel,
    the `[1, N]` row scale, the fused static input scale), run through `fp8_linear_mm` wherever
    torch._scaled_mm runs (CPU on recent torch), against the reference path of the loaded layer."""
    ckpt, _ = fp8_dirs[fmt]
    model, _ = load_model(ckpt, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(3)
    for module in (model.layers[0].qkv_proj, model.layers[1].down_proj):
        x = torch.randn(8, module.weight.shape[1], generator=gen)
        ref = module(x)
        module.finish(True)
        assert module.block is None and module.scale_row.shape == (1, module.weight.shape[0])
        assert (module.static_input_scale is not None) == (fmt == "ct-tensor-static")
        requantized = module(x)  # the reference path over the GPU's per-channel operands
        assert ((requantized - ref).abs().max() / ref.abs().max()).item() < 0.03
        try:
            out = fp8_linear_mm(x, module.weight, module.scale_row, module.static_input_scale)
        except (RuntimeError, NotImplementedError) as exc:
            pytest.skip(f"torch._scaled_mm does not run here: {exc}")
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 0.08


def test_fp8_kv_cache_on_the_torch_path(smollm2_path, caplog):
    """--kv-cache-dtype fp8: the cache holds E4M3, attention reads it back in the activation dtype;
    the embedded model's greedy tokens stay with the float cache's; the capacity gain is logged
    (the Triton path: tests/integration/test_fp8_kv.py)."""
    import logging

    with caplog.at_level(logging.INFO):
        engine = make_engine(smollm2_path, kv_cache_dtype="fp8")
    assert engine.runner.kv_cache.dtype == FP8_DTYPE
    assert "KV cache fp8: 1.0x the blocks of fp32" in caplog.text  # --max-total-tokens fixes the count
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:4]]
    params = SamplingParams(max_new_tokens=8)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    want = [r.token_ids for r in make_engine(smollm2_path).generate(prompts, params)]
    assert sum(g[:4] == w[:4] for g, w in zip(got, want, strict=True)) >= len(prompts) - 1, (got, want)
