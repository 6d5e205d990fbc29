"""Block-wise FP8 checkpoints whose projections are not multiples of the block: the scale grid is
ceil(rows / bn) x ceil(cols / bk), the last row and column blocks partial (e.g. the embedded
SmolLM2's 576-wide projections under 128x128 blocks). Each stacked projection's rows keep their own
blocks' scales (a (1, bk) grid), so the fused q/k/v and gate/up linears load them.

The CPU reference path generates exactly what transformers generates in float32 over the
checkpoint's dequantized weights; the GPU's operands (the weight-only Triton GEMM over the row
grid, and the per-channel re-quantization `finish(fast=True)` makes) are checked on the CPU under
the Triton interpreter in a child process (`python -m tests.integration.test_fp8_partial_blocks`).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from loraplex.kernels.fp8_matmul import dequantize
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.models.quantization.fp8_linear import Fp8Linear
from loraplex.services.inference.models.quantization.scheme import Fp8Scheme
from tests.integration.test_engine_correctness import PROMPTS, hf_greedy, make_engine
from tests.support.child import assert_interpreter_checks_pass
from tests.support.fp8_checkpoints import dequantize_checkpoint, write_fp8_checkpoint
from tests.support.lora_kinds import engine_run, peft_reference
from tests.support.lora_reference import server_args, sync_engine


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


def check_matches_reference(src, tmp_path, block: tuple[int, int], prompts: int, new_tokens: int) -> None:
    ckpt = write_fp8_checkpoint(src, tmp_path / "fp8", "fp8-block", block=block)
    ref = dequantize_checkpoint(ckpt, tmp_path / "ref")
    engine = make_engine(ckpt, page_size=4)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert linears and any(m.block == (1, block[1]) for m in linears), "no projection has a partial block"
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS[:prompts]]
    results = engine.generate(ids, SamplingParams(max_new_tokens=new_tokens))
    assert [r.token_ids for r in results] == hf_greedy(ref, ids, new_tokens)


def test_partial_edge_blocks_match_the_dequantized_reference(tiny_llama_path, tmp_path):
    """48x48 blocks over 64-, 32- and 128-row projections and 64/128 columns: partial blocks on
    both axes, and k/v (32 rows) a single partial block."""
    check_matches_reference(tiny_llama_path, tmp_path, (48, 48), len(PROMPTS), 24)


def test_dora_over_a_partial_block_base_matches_peft_over_its_dequantized_weights(
    tiny_llama_path, adapter_factory, tmp_path
):
    """DoRA's norms come from the FP8 base's dequantized rows (`lora_base_weight`), as PEFT's come
    from the float weights it runs on."""
    ckpt = write_fp8_checkpoint(tiny_llama_path, tmp_path / "fp8", "fp8-block", block=(48, 48))
    ref = dequantize_checkpoint(ckpt, tmp_path / "ref")
    adapters = {
        "dora": adapter_factory(
            tiny_llama_path, "fp8-dora", r=4, target_modules=["q_proj", "k_proj", "down_proj"], use_dora=True
        )
    }
    engine = sync_engine(server_args(ckpt, adapters, max_loras_per_batch=1))
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:3]]
    batch = [None, "dora", "dora"]
    ours = engine_run(engine, prompts, batch)
    expected = peft_reference(ref, adapters, list(zip(prompts, batch, strict=True)))
    for (tokens, logprobs), (want, want_lp) in zip(ours, expected, strict=True):
        assert tokens == want[: len(tokens)]
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp, strict=False)) < 1e-4


@pytest.mark.slow
def test_embedded_model_in_128_blocks_matches_the_dequantized_reference(smollm2_path, tmp_path):
    """SmolLM2-135M: 576-row q/o (4.5 blocks of 128), 192-row k/v, 1536-wide MLP."""
    check_matches_reference(smollm2_path, tmp_path, (128, 128), 2, 8)


def test_gpu_operands_of_partial_blocks_under_the_interpreter():
    assert_interpreter_checks_pass("tests.integration.test_fp8_partial_blocks", timeout=300)


def _partial_linear(gen: torch.Generator) -> tuple[Fp8Linear, torch.Tensor]:
    """A fused linear of 40- and 24-row projections over 80 columns in 16x32 blocks, its scales
    loaded from per-projection checkpoint grids; returns it and its dequantized float32 weight."""
    block, sizes, k = (16, 32), (40, 24), 80
    lin = Fp8Linear(k, sizes, False, Fp8Scheme("fp8 block-wise 16x32", prequantized=True, block=block))
    assert lin.block == (1, 32) and lin.weight_scale.shape == (64, 3)
    parts = []
    for i, n in enumerate(sizes):
        w = (torch.randn(n, k, generator=gen) * 0.1).to(lin.weight.dtype)
        grid = torch.rand(math.ceil(n / 16), math.ceil(k / 32), generator=gen) + 0.25
        lin.load_shard(i, "weight", w)
        lin.load_scale(i, "weight_scale_inv", grid)
        parts.append(dequantize(w, grid, block, torch.float32))
    return lin, torch.cat(parts)


def _interpreter_checks() -> int:
    from loraplex.kernels.placement import run_triton_on_cpu
    from loraplex.kernels.settings import reload_kernel_settings

    failures = 0
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 80, generator=gen)
    lin, weight = _partial_linear(gen)
    ref = x @ weight.T
    err = ((lin(x) - ref).abs().max() / ref.abs().max()).item()
    ok = err < 1e-6
    failures += not ok
    print(
        f"reference path over the row grid vs the dequantized projections: {err:.1e} {'ok' if ok else 'FAIL'}"
    )
    reload_kernel_settings({"TRITON_INTERPRET": "1", "LORAPLEX_FP8_GEMM": "weight_only"})
    run_triton_on_cpu(True)
    try:
        out = lin(x)
    finally:
        run_triton_on_cpu(False)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    ok = err < 1e-5
    failures += not ok
    print(f"weight-only Triton GEMM over the row grid: {err:.1e} {'ok' if ok else 'FAIL'}")
    reload_kernel_settings({"TRITON_INTERPRET": "1", "LORAPLEX_FP8_GEMM": "auto"})
    lin.finish(True)  # re-quantized per output channel, as on the GPU for torch._scaled_mm / W8A8
    err = ((lin(x) - ref).abs().max() / ref.abs().max()).item()
    ok = lin.block is None and err < 0.03
    failures += not ok
    print(f"per-channel re-quantization at load: {err:.1e} {'ok' if ok else 'FAIL'}")
    print("checked")
    return failures


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 to run the kernels on the CPU")
    sys.exit(1 if _interpreter_checks() else 0)
