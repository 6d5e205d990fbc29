"""The piecewise path for mixed steps (engine/mixed_graphs.py) gives the outputs of the plain step.

On the CPU the pieces run eagerly over the same static buffers, padding and bucket choice as the
CUDA graphs replay them (the graphs themselves are checked on the GPU by bench/mixed_graph_check.py):
so the cut at attention, the hand-over buffers and the padding rows are covered here, through the
real engine, against transformers/PEFT and the engine without the path, with chunked prefill,
preemption, a decode-prefill budget and adapters.
"""

from __future__ import annotations

import pytest

from loraplex.services.inference.engine.mixed_graphs import lora_tier, mixed_buckets
from loraplex.services.inference.engine.types import SamplingParams
from tests.integration.test_engine_correctness import PROMPTS, hf_greedy, make_engine
from tests.support.lora_reference import BATCH as LORA_BATCH
from tests.support.lora_reference import make_adapters, peft_greedy, server_args, sync_engine

NEW_TOKENS = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


def test_buckets_line_up_with_the_kernel_families():
    assert mixed_buckets(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert mixed_buckets(100) == [16, 32, 64, 100]
    assert mixed_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert mixed_buckets(10) == [10] and mixed_buckets(0) == []
    assert [lora_tier(d) for d in (0, 1, 16, 17, 64)] == [0, 1, 1, 2, 2]


def test_bucket_and_tier_choice(tiny_llama_path):
    engine = make_engine(tiny_llama_path, mixed_graphs=True)
    graphs = engine.runner.mixed_graphs
    assert graphs is not None and graphs.buckets == [16, 32, 64] and graphs.tiers() == (0,)
    assert graphs.key(1, 0) == (16, 0) and graphs.key(17, 0) == (32, 0) and graphs.key(64, 0) == (64, 0)
    assert graphs.key(65, 0) is None  # larger than the biggest bucket: eager
    assert graphs.key(10, 2) is None  # adapters but no LoRA backend
    off = make_engine(tiny_llama_path)
    assert off.runner.mixed_graphs is None  # on the CPU the path is off unless forced
    none = make_engine(tiny_llama_path, mixed_graphs=True, mixed_cuda_graph_max_tokens=0)
    assert none.runner.mixed_graphs is None


def test_mixed_batch_matches_transformers_with_pieces(tiny_llama_path):
    engine = make_engine(tiny_llama_path, mixed_graphs=True, page_size=4)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == hf_greedy(tiny_llama_path, prompts, NEW_TOKENS)
    assert engine.runner.mixed_graphs.steps_run > 5, "mixed steps went through the pieces"
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_preemption_and_decode_budget_keep_outputs(tiny_llama_path):
    plain = make_engine(tiny_llama_path)
    prompts = [plain.tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, params)]
    need = max(len(p) for p in prompts) + NEW_TOKENS
    engine = make_engine(
        tiny_llama_path, mixed_graphs=True, max_total_tokens=3 * need, page_size=8, decode_prefill_budget=3
    )
    assert [r.token_ids for r in engine.generate(prompts, params)] == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.mixed_graphs.steps_run > 0
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_smollm2_with_pieces_matches_transformers(smollm2_path):
    engine = make_engine(smollm2_path, mixed_graphs=True)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:4]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [r.token_ids for r in results] == hf_greedy(smollm2_path, prompts, 8)
    assert engine.runner.mixed_graphs.steps_run > 0


def test_mixed_lora_batch_with_pieces_matches_peft(tiny_llama_path, adapter_factory):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "mixed-pieces")
    engine = sync_engine(
        server_args(tiny_llama_path, adapters, max_loras_per_batch=4, max_gpu_loras=4, chunked_prefill_size=8)
    )
    # Forced on after construction (ServerArgs has no CPU switch): pieces run eagerly, LoRA inside them.
    engine.runner.capture_mixed_graphs(64, use_graphs=False)
    assert engine.runner.mixed_graphs.tiers() == (0, 1)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(LORA_BATCH)]]
    got = [
        c.token_ids
        for c in engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), list(LORA_BATCH))
    ]
    want = peft_greedy(tiny_llama_path, adapters, list(zip(prompts, LORA_BATCH, strict=True)), NEW_TOKENS)
    assert got == want
    assert engine.runner.mixed_graphs.steps_run > 0
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
