"""The default `--expert-lora-mode auto` on CUDA, end to end through the engine: a tiny Qwen3-MoE with
expert adapters (mixed ranks) gets the graphs mode, keeps its decode CUDA graphs, compiles no Triton
kernel while serving (the warm-up compiled the per-pair kernel), and generates the tokens the eager
grouped mode generates. CUDA only (on the GPU machine:
`python3 -m pytest -m gpu tests/integration/test_gpu_moe_expert_lora.py`); the CPU tests check the
same paths against PEFT in float32 (test_moe_models.py, test_moe_grouped.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
BATCH = [None, "e16", "e8", "e16", None, "e8", "e16", "e8"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_mode_serves_expert_lora_in_cuda_graphs_as_the_eager_mode_does(tmp_path):
    from loraplex.bench.serving_setup import write_tokenizer
    from loraplex.kernels.compile_watch import compile_counter
    from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
    from tests.integration.test_model_families import run_engine
    from tests.support.factories import make_peft_adapter, make_tiny_model
    from tests.support.lora_reference import server_args, sync_engine

    base = make_tiny_model(
        tmp_path / "base", arch="qwen3_moe", hidden_size=128, intermediate_size=256, vocab_size=512,
        moe_intermediate_size=64,
    )  # fmt: skip
    write_tokenizer(base, 512)
    adapters = {
        "e16": make_peft_adapter(
            base, tmp_path / "e16", r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
            target_parameters=EXPERTS, seed=31, rank_pattern={"down_proj": 8},
        ),
        "e8": make_peft_adapter(
            base, tmp_path / "e8", r=8, lora_alpha=16, target_modules=["o_proj"], target_parameters=EXPERTS,
            seed=32,
        ),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 17, 5, 30, 12, 21, 7, 14)]
    tokens = {}
    for mode in ("auto", "grouped"):
        engine = sync_engine(
            server_args(
                base, adapters, device="cuda", dtype="bfloat16", max_loras_per_batch=2, page_size=16,
                max_total_tokens=4096, context_length=512, chunked_prefill_size=64,
                max_num_batched_tokens=128, expert_lora_mode=mode,
            )
        )  # fmt: skip
        graphs = getattr(engine.runner, "cuda_graphs", None)
        if mode == "auto":
            assert isinstance(engine.runner.lora_backend.experts, GraphExpertLoRA)
            assert graphs is not None, "the graphs mode keeps the decode CUDA graphs"
        else:
            assert graphs is None, "the host-reading mode turns them off"
        compiled = compile_counter.after_start
        tokens[mode] = [t for t, _ in run_engine(engine, prompts, BATCH)]
        assert compile_counter.after_start == compiled, f"{mode}: Triton compiled while serving"
        del engine
        torch.cuda.empty_cache()
    assert tokens["auto"] == tokens["grouped"]
