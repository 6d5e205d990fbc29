"""Log probabilities from the engine equal log_softmax of transformers' (and PEFT's) logits.

One continuous batch mixes base and adapter rows, greedy and seeded sampling, rows with and
without log probabilities, with and without overlap scheduling; the reference runs each
finished sequence through transformers / PEFT once and reads the logits at every generated
position. Timing fields are checked for consistency (queue time <= time to first token).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.services.inference.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from loraplex.services.inference.errors import InvalidRequest
from tests.support.lora_reference import server_args, sync_engine

NEW_TOKENS = 8
TOL = 1e-4
JOBS = [  # (prompt, adapter, params)
    ("The capital of France is", None, SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=5)),
    ("def fibonacci(n):", "a", SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=3)),
    ("Water boils at", None, SamplingParams(max_new_tokens=NEW_TOKENS)),
    ("Once upon a time", "a", SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7, logprobs=0)),
    (
        "1, 2, 3, 4,",
        None,
        SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=20, seed=3, logprobs=MAX_TOP_LOGPROBS
        ),
    ),
    # prompt log probabilities over several prefill chunks (the engine's chunk is 8 tokens)
    (
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and",
        "a",
        SamplingParams(max_new_tokens=2, prompt_logprobs=3),
    ),
    (
        "Translate to French: I would like a cup of coffee, please.",
        None,
        SamplingParams(max_new_tokens=3, prompt_logprobs=0, logprobs=1),
    ),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def adapter(tiny_llama_path, adapter_factory):
    return adapter_factory(
        tiny_llama_path,
        "logprobs-a",
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        seed=5,
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_path, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, adapter, adapter_name="a").eval()

    @torch.no_grad()
    def logprobs(ids: list[int], prompt_len: int, name: str | None) -> torch.Tensor:
        """log_softmax at the positions predicting ids[prompt_len:] (prompt_len 1: every token after
        the first)."""
        x = torch.tensor([ids])
        if name is None:
            with peft.disable_adapter():
                logits = peft(input_ids=x).logits[0]
        else:
            logits = peft(input_ids=x).logits[0]
        return logits[prompt_len - 1 : len(ids) - 1].float().log_softmax(dim=-1)

    return logprobs


def run(engine, jobs):
    prompts = [engine.tokenizer(p).input_ids for p, _, _ in jobs]
    for i, (prompt, (_, name, params)) in enumerate(zip(prompts, jobs, strict=True)):
        engine.add_request(f"r{i}", prompt, params, name)
    got = {f"r{i}": {"ids": [], "lps": [], "prompt": [], "final": None} for i in range(len(jobs))}
    while any(g["final"] is None for g in got.values()):
        for out in engine.step():
            g = got[out.request_id]
            g["ids"].extend(out.new_token_ids)
            if out.logprobs is not None:
                g["lps"].extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert not g["prompt"] and len(g["ids"]) == len(out.new_token_ids) == 1, (
                    "once, with the first token"
                )
                g["prompt"] = out.prompt_logprobs
            if out.finished:
                g["final"] = out
    return prompts, [got[f"r{i}"] for i in range(len(jobs))]


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_match_transformers_and_peft(tiny_llama_path, adapter, reference, overlap):
    engine = sync_engine(server_args(tiny_llama_path, {"a": adapter}))
    engine.config = dataclasses.replace(engine.config, overlap_schedule=overlap)
    assert engine._overlap is overlap
    prompts, results = run(engine, JOBS)
    for prompt, (_, name, params), got in zip(prompts, JOBS, results, strict=True):
        if params.prompt_logprobs is not None:
            assert [lp.token_id for lp in got["prompt"]] == prompt[1:] and len(
                prompt
            ) > 8  # two or more chunks
            ref = reference(prompt, 1, name)
            for pos, lp in enumerate(got["prompt"]):
                assert abs(lp.logprob - ref[pos, lp.token_id].item()) < TOL, (name, "prompt", pos)
                assert len(lp.top) == params.prompt_logprobs
                for token, value in lp.top:
                    assert abs(ref[pos, token].item() - value) < TOL
                if lp.top:
                    assert lp.top[0][0] == ref[pos].argmax().item()
        else:
            assert got["prompt"] == []
        if params.logprobs is None:
            assert got["lps"] == [] and got["final"].logprobs is None
            continue
        assert [lp.token_id for lp in got["lps"]] == got["ids"]
        ref = reference(prompt + got["ids"], len(prompt), name)
        for pos, lp in enumerate(got["lps"]):
            assert abs(lp.logprob - ref[pos, lp.token_id].item()) < TOL, (name, pos)
            assert len(lp.top) == params.logprobs
            if params.logprobs:
                values, _ = ref[pos].topk(params.logprobs)
                assert torch.allclose(torch.tensor([v for _, v in lp.top]), values, atol=TOL)
                for token, value in lp.top:
                    assert abs(ref[pos, token].item() - value) < TOL
            if params.temperature == 0:  # greedy: the chosen token is the most likely one
                assert abs(lp.logprob - ref[pos].max().item()) < TOL
        final = got["final"]
        assert 0 <= final.queue_time < final.time_to_first_token  # the prefill forward lies between
        assert final.cached_prompt_tokens == 0


def test_top_logprobs_bound(tiny_llama_path):
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        SamplingParams(logprobs=MAX_TOP_LOGPROBS + 1).validate()


def test_prompt_logprobs_survive_preemption(tiny_llama_path):
    """A preempted request recomputes its prompt: its prompt log probabilities are not repeated."""
    from tests.integration.test_engine_correctness import PROMPTS
    from tests.integration.test_engine_overlap import make_engine

    probe = make_engine(tiny_llama_path, False)
    prompts = [probe.tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, prompt_logprobs=1)
    want = run(probe, [(p, None, params) for p in PROMPTS])[1]
    need = max(len(p) for p in prompts) + 16
    engine = make_engine(tiny_llama_path, False, max_total_tokens=3 * need)
    got = run(engine, [(p, None, params) for p in PROMPTS])[1]
    assert engine.scheduler.num_preemptions > 0
    for prompt, g, w in zip(prompts, got, want, strict=True):
        assert [lp.token_id for lp in g["prompt"]] == prompt[1:]
        assert [lp.logprob for lp in g["prompt"]] == pytest.approx(
            [lp.logprob for lp in w["prompt"]], abs=TOL
        )
