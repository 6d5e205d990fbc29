"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers + PEFT: greedy tokens equal and log
probabilities within 1e-4, for the base model and two adapters in one mixed batch.

Each family is a tiny random model with its features on (tests/support/factories.py
FAMILY_CONFIGS): q/k norms, sandwich norms, GeGLU, soft-capping, a local rope, longrope, fused
qkv/gate_up checkpoint tensors, and sliding windows (12 tokens) shorter than every context here
(prompts of 7-14 tokens + 24 new). The engine runs with chunked prefill (8-token chunks, so later
chunks attend over earlier pages through the window), the prefix cache on (a repeated prompt hits
it) and a KV cache small enough to preempt; the reference runs one sequence at a time with eager
attention.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.types import SamplingParams
from tests.support.child import REPO, child_env, run_child
from tests.support.factories import make_tiny_model
from tests.support.lora_reference import server_args, sync_engine

NEW_TOKENS = 24
# Phi-3's adapters target its fused modules (one A, one B over the whole fused output).
ADAPTERS = {
    "default": {
        "a4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], seed=11),
        "b8": dict(
            r=8, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "gate_proj", "up_proj"], seed=12
        ),
    },
    "phi3": {
        "a4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "down_proj"], seed=11),
        "b8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "gate_up_proj"], seed=12),
    },
}
PROMPTS = [
    "The capital of France is a city that",
    "def fibonacci(n): return n if n < 2 else",
    "Once upon a time, in a land far far away, there lived a",
    "The capital of France is a city that",  # same prompt, other adapter: its own prefix chain
    "Water boils at one hundred degrees and",
    "The capital of France is a city that",  # same prompt as the first, base again: a prefix-cache hit
]
BATCH = [None, "a4", "b8", "a4", None, None]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


def reference(base: Path, adapters: dict[str, Path], jobs: list[tuple[list[int], str | None]]):
    """PEFT's greedy tokens and per-step log-softmax rows, one sequence at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    names = sorted(adapters)
    peft = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    results = []
    with torch.no_grad():
        for ids, name in jobs:
            kw = dict(
                input_ids=torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                return_dict_in_generate=True,
                output_logits=True,
            )
            if name is None:
                with peft.disable_adapter():
                    gen = peft.generate(**kw)
            else:
                peft.set_adapter(name)
                gen = peft.generate(**kw)
            logprobs = torch.stack([lg[0] for lg in gen.logits]).float().log_softmax(-1)
            results.append((gen.sequences[0, len(ids) :].tolist(), logprobs))
    return results


def run_engine(engine, prompts: list[list[int]], adapters: list[str | None]):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    ids = [f"fam-{i}" for i in range(len(prompts))]
    for rid, prompt, adapter in zip(ids, prompts, adapters, strict=True):
        engine.check_request(prompt, params)
        engine.add_request(rid, prompt, params, adapter)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list] = {rid: [] for rid in ids}
    finished = set()
    while len(finished) < len(ids):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            if out.finished:
                finished.add(out.request_id)
    return [(tokens[rid], logprobs[rid]) for rid in ids]


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_family_matches_transformers_and_peft(arch, tmp_path_factory, smollm2_path, adapter_factory):
    base = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, tokenizer_from=smollm2_path)
    adapters = {
        name: adapter_factory(base, f"fam-{arch}-{name}", **kw)
        for name, kw in ADAPTERS.get(arch, ADAPTERS["default"]).items()
    }
    engine = sync_engine(
        server_args(
            base,
            adapters,
            max_loras_per_batch=1,
            page_size=4,
            max_total_tokens=96,  # six sequences of up to 44 tokens: preemption by recompute
            context_length=256,
        )
    )
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    # every context passes the 12-token window; one prompt alone does (its later chunks read through it)
    assert max(len(p) for p in prompts) > 12
    got = run_engine(engine, prompts, BATCH)
    expected = reference(base, adapters, list(zip(prompts, BATCH, strict=True)))
    for (tokens, logprobs), (ref_tokens, ref_logprobs), name in zip(got, expected, BATCH, strict=True):
        assert tokens == ref_tokens, f"{arch} adapter {name}: engine {tokens} != PEFT {ref_tokens}"
        for step, lp in enumerate(logprobs):
            row = ref_logprobs[step]
            assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4, (arch, name, step)
            for token, value in lp.top:
                assert abs(value - row[token].item()) < 1e-4, (arch, name, step, token)
    # The adapters change the output, the prefix cache was hit and a request was preempted.
    assert len({tuple(expected[i][0]) for i in (0, 1, 2)}) == 3 or expected[0][0] != expected[3][0]
    assert expected[0][0] != expected[3][0], "adapter a4 changes the first prompt's tokens"
    stats = engine.stats()
    assert sum(stats.prefix_cache_hit_tokens.values()) > 0
    assert engine.scheduler.num_preemptions > 0


def test_every_family_on_the_cuda_path_kernels_under_the_interpreter():
    """The fused kernels, the windowed / soft-capped Triton attention and the Triton LoRA backend
    give each family's torch-path logits (tests/support/family_triton_check.py, TRITON_INTERPRET=1)."""
    script = str(REPO / "tests" / "support" / "family_triton_check.py")
    proc = run_child([script], env=child_env(interpret=True), timeout=600)
    for family in ("llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"):
        assert f"{family}: triton path vs torch path" in proc.stdout and "FAIL" not in proc.stdout
