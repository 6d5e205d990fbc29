"""The engine with speculative decoding on gives the outputs it gives with it off: greedy tokens and
log probabilities, base and adapters in one batch, stops inside an accepted run."""

from __future__ import annotations

import pytest

from loraplex.services.inference.engine.types import SamplingParams
from tests.support.lora_reference import server_args, sync_engine

PROMPTS = [
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "the cat sat on the mat. the cat sat on the",
    "def f(x): return x\ndef g(x): return",
    "Hello Hello Hello Hello",
]


def _run(engine, prompts, params, adapters):
    outs = engine.generate(prompts, params, adapters)
    return [o.token_ids for o in outs]


def oracle(continuations: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
    """A proposer for random weights (which never repeat, so n-grams find nothing): the known
    continuation of the request's prompt, with every `wrong_every`-th draft position corrupted, so
    verification both accepts and rejects."""
    calls = [0]

    def propose(token_ids: list[int], k: int) -> list[int]:
        for prompt, cont in continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = list(cont[done : done + k])
                calls[0] += 1
                if draft and calls[0] % wrong_every == 0:
                    draft[-1] = (draft[-1] + 1) % 1000
                return draft
        return []

    return propose


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    return {
        "a": adapter_factory(tiny_llama_path, "spec-a", r=8, target_modules=["q_proj", "v_proj"], seed=3),
        "b": adapter_factory(tiny_llama_path, "spec-b", r=4, target_modules=["o_proj", "down_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def engines(tiny_llama_path, adapters):
    off = sync_engine(server_args(tiny_llama_path, adapters))
    on = sync_engine(server_args(tiny_llama_path, adapters, speculative_algorithm="ngram"))
    return off, on


def _with_oracle(on, prompts, want, names):
    conts = {tuple(p): w for p, w, name in zip(prompts, want, names, strict=True)}
    on.speculator.propose = oracle(conts)


def test_greedy_outputs_equal_with_and_without_speculation(engines, one_torch_thread):
    """Base and two adapters in one batch, greedy, with log probabilities: speculation changes only how
    many tokens a step emits (and it did emit several: drafts were accepted and rejected)."""
    off, on = engines
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", "a"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    want_outs = off.generate(prompts, params, names)
    want = [o.token_ids for o in want_outs]
    _with_oracle(on, prompts, want, names)
    before = on.stats()
    got = on.generate(prompts, params, names)
    assert [o.token_ids for o in got] == want
    stats = on.stats()
    drafted = sum(stats.spec_draft_tokens.values()) - sum(before.spec_draft_tokens.values())
    accepted = sum(stats.spec_accepted_tokens.values()) - sum(before.spec_accepted_tokens.values())
    assert 0 < accepted < drafted, (accepted, drafted)
    assert set(stats.spec_draft_tokens) == {"", "a", "b"}


def test_logprobs_equal_with_and_without_speculation(engines, one_torch_thread):
    off, on = engines
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS[:2]]
    names = [None, "b"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = _run(off, prompts, params, names)
    _with_oracle(on, prompts, want, names)
    rid = "lp"
    for engine in (off, on):
        engine.add_request(
            rid, prompts[1], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3), "b"
        )
    got = {}
    for name, engine in (("off", off), ("on", on)):
        lps = []
        while engine.has_unfinished():
            for out in engine.step():
                lps.extend(out.logprobs or [])
        got[name] = lps
    assert [lp.token_id for lp in got["on"]] == want[1]
    assert len(got["on"]) == len(got["off"]) == 12
    for a, b in zip(got["on"], got["off"], strict=True):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_stops_inside_an_accepted_run(engines, one_torch_thread):
    """max_new_tokens and stop token ids end a request in the middle of a verified run exactly where
    they end it without speculation."""
    off, on = engines
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", None]
    free = _run(off, prompts, SamplingParams(max_new_tokens=16, ignore_eos=True), names)
    _with_oracle(on, prompts, free, names)
    for n in (1, 2, 5, 7):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        assert _run(on, prompts, params, names) == [f[:n] for f in free]
    stop_at = free[0][9]  # a token the base request emits 10th (maybe earlier, too)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop_at,))
    want = _run(off, prompts, params, names)
    assert _run(on, prompts, params, names) == want
    assert len(want[0]) <= 10 and want[0][-1] == stop_at
