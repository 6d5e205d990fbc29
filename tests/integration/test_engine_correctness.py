"""Greedy outputs of our engine equal transformers `generate(do_sample=False)` token for token.

Prompts of different lengths run in ONE continuous batch with chunked prefill forced small
enough to split them, so mixed prefill+decode steps, chunking over earlier pages, GQA,
biases, tied embeddings and Llama 3 RoPE scaling are all exercised against the reference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import SamplingParams
from tests.support.factories import make_tiny_model

PROMPTS = [
    "The capital of France is",
    "List 3 countries and their capitals.",
    "def fibonacci(n):",
    "Once upon a time, in a land far far away, there lived a",
    "1, 2, 3, 4,",
    "Hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and",
    "Water boils at",
]
NEW_TOKENS = 32
CHUNK = 8  # smaller than most prompts: they are prefilled over several steps


def make_engine(path: Path, **overrides) -> LLMEngine:
    options = dict(
        model_path=str(path),
        device=torch.device("cpu"),
        dtype="float32",
        chunked_prefill_size=CHUNK,
        max_num_batched_tokens=64,
        max_total_tokens=4096,
        context_length=1024,
    )
    options.update(overrides)
    return LLMEngine.from_config(EngineConfig(**options))


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), cut after EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[
                0, len(ids) :
            ]
            tokens = gen.tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            outs.append(tokens[:cut])
    return outs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def smol(smollm2_path):
    engine = make_engine(smollm2_path)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    assert max(len(p) for p in prompts) > 2 * CHUNK and min(len(p) for p in prompts) < CHUNK
    return engine, prompts


@pytest.fixture(scope="module")
def smol_reference(smollm2_path, smol):
    return hf_greedy(smollm2_path, smol[1])


def test_smollm2_mixed_batch_matches_transformers(smol, smol_reference):
    engine, prompts = smol
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    for prompt, ref, res in zip(PROMPTS, smol_reference, results, strict=True):
        assert res.token_ids == ref, f"prompt {prompt!r} diverged"
        assert res.text == engine.tokenizer.decode(ref, skip_special_tokens=True)
        assert res.finish_reason == ("stop" if len(ref) < NEW_TOKENS else "length")
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_batch_invariance(smol, smol_reference):
    engine, prompts = smol
    for prompt, ref in zip(prompts[:3], smol_reference[:3], strict=True):
        (alone,) = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))
        assert alone.token_ids == ref


def test_preemption_by_recompute_keeps_outputs(smollm2_path, smol, smol_reference):
    _, prompts = smol
    need = max(len(p) for p in prompts) + NEW_TOKENS
    # Room for about three sequences at a time: the batch of eight must preempt to finish.
    engine = make_engine(smollm2_path, max_total_tokens=3 * need, page_size=8)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == smol_reference
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_tiny_models_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    engine = make_engine(path, page_size=4)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == hf_greedy(path, prompts)


def test_llama3_rope_scaling_matches_transformers(tmp_path, smollm2_path):
    from transformers import AutoModelForCausalLM

    from loraplex.services.inference.models.config import load_config
    from loraplex.services.inference.models.rope import inverse_frequencies

    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = make_tiny_model(
        tmp_path / "llama3", rope_scaling=rope_scaling, tokenizer_from=smollm2_path, seed=3
    )
    cfg = load_config(path)
    assert cfg.rope.rope_type == "llama3"
    ours = inverse_frequencies(cfg.rope, cfg.head_dim)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    plain = inverse_frequencies(dataclasses.replace(cfg.rope, rope_type="default"), cfg.head_dim)
    assert not torch.equal(ours, plain)  # the scaling really changes frequencies here

    engine = make_engine(path, page_size=4)
    long_text = " ".join(PROMPTS)  # positions well past original_max_position_embeddings
    prompts = [engine.tokenizer(long_text).input_ids, engine.tokenizer(PROMPTS[1]).input_ids]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == hf_greedy(path, prompts)
