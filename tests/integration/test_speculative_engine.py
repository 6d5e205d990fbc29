"""The engine with speculative decoding on gives the outputs it gives with it off: greedy tokens and
log probabilities, base and adapters in one batch, stops inside an accepted run."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.services.inference.engine.types import SamplingParams
from tests.support.chi_square import chi_square_p
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


@pytest.mark.parametrize("layout", ["decode_rows", "segments"])
def test_greedy_outputs_equal_with_and_without_speculation(engines, layout, one_torch_thread, monkeypatch):
    """Base and two adapters in one batch, greedy, with log probabilities: speculation changes only how
    many tokens a step emits (and it did emit several: drafts were accepted and rejected). Both layouts
    of a verify step: its chunks as decode rows (steps of decodes and verify chunks, the CUDA graph
    path on a GPU) and as prefill segments (the layout of a verify step that holds a prefill chunk)."""
    off, on = engines
    runner = on.runner
    taken = []
    as_rows = type(runner)._verify_as_decode_rows

    def spy(self, chunks):
        taken.append(as_rows(self, chunks))
        return taken[-1]

    monkeypatch.setattr(type(runner), "_verify_as_decode_rows", spy)
    if layout == "segments":
        monkeypatch.setattr(runner, "max_decode_rows", 0)
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", "a"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    want_outs = off.generate(prompts, params, names)
    want = [o.token_ids for o in want_outs]
    _with_oracle(on, prompts, want, names)
    before = on.stats()
    got = on.generate(prompts, params, names)
    assert [o.token_ids for o in got] == want
    assert any(taken) == (layout == "decode_rows"), taken
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


TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump!"
)
CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    + "def mul(a, b):\n    return a * b\n"
)
COPY_HEAVY = [
    "Repeat this text exactly:\n" + TEXT,
    "Rename the function add to plus in this code and print the whole code:\n" + CODE,
    "Summarize in one sentence, reusing its words: " + TEXT,
]


def test_ngram_acceptance_on_the_embedded_model(smollm2_path, adapter_factory, one_torch_thread):
    """Prompt lookup on real weights and copy-heavy prompts (repeat, edit, summarize), base and two
    adapters: at K = 4 at least half the draft tokens are accepted (each adapter's own output is what
    its drafts copy from), and greedy outputs equal speculation off."""
    adapters = {
        name: adapter_factory(smollm2_path, f"spec-{name}", r=8, seed=seed, scale=0.05)
        for name, seed in (("x", 51), ("y", 52))
    }
    kw = dict(max_num_batched_tokens=512, chunked_prefill_size=512)
    off = sync_engine(server_args(smollm2_path, adapters, **kw))
    on = sync_engine(server_args(smollm2_path, adapters, speculative_algorithm="ngram", **kw))
    prompts = [
        off.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in COPY_HEAVY
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    names = [None, "x", "y"]
    params = SamplingParams(max_new_tokens=48)
    assert _run(on, prompts, params, names) == _run(off, prompts, params, names)
    stats = on.stats()
    rates = {a: stats.spec_accepted_tokens[a] / stats.spec_draft_tokens[a] for a in stats.spec_draft_tokens}
    print("n-gram acceptance per adapter at K=4:", rates)
    assert set(rates) == {"", "x", "y"}
    total = sum(stats.spec_accepted_tokens.values()) / sum(stats.spec_draft_tokens.values())
    assert total >= 0.5, rates


def test_sampled_outputs_follow_the_targets_distribution(tiny_llama_path, one_torch_thread):
    """Sampling with speculation on: the token after a verified draft is distributed as the target
    says. Many seeded requests (top_k 4, so the support is small) draft the same token after their
    first one; the second token's counts, among requests whose first token was the most common one,
    pass a chi-square test against that context's top-4 distribution read from the model."""
    kw = dict(max_num_batched_tokens=4096, chunked_prefill_size=4096, max_running_requests=1024)
    spec = dict(speculative_algorithm="ngram", speculative_disable_batch_size=4096)
    on = sync_engine(server_args(tiny_llama_path, None, **spec, **kw))
    off = sync_engine(server_args(tiny_llama_path, None, **kw))
    prompt = on.tokenizer("Once upon a time").input_ids
    # max_new_tokens 3: the draft after the first token leaves room for the verification's bonus token
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, seed=s) for s in range(800)]
    # The first token's likeliest value (top 4 of the prompt's last row).
    off.add_request("p", prompt, SamplingParams(max_new_tokens=1, logprobs=4))
    top = []
    while off.has_unfinished():
        for out in off.step():
            top = out.logprobs[0].top if out.logprobs else top
    assert top
    t1 = top[0][0]
    # The target for the second token given prompt + t1, and a draft that is accepted about half the time.
    target = {}
    off.add_request("q", prompt + [t1], SamplingParams(max_new_tokens=1, logprobs=4))
    while off.has_unfinished():
        for out in off.step():
            target = dict(out.logprobs[0].top) if out.logprobs else target
    norm = sum(math.exp(v) for v in target.values())
    probs = {t: math.exp(v) / norm for t, v in target.items()}
    draft = max(probs, key=probs.get)
    on.speculator.propose = lambda ids, k: [draft] if len(ids) == len(prompt) + 1 else []
    outs = on.generate([prompt] * len(params), params)
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == t1]
    assert len(seconds) > 200, len(seconds)
    assert sum(on.stats().spec_draft_tokens.values()) > 0
    counts = [seconds.count(t) for t in probs]
    assert sum(counts) == len(seconds), "a token outside the top 4 was emitted"
    assert chi_square_p(counts, list(probs.values())) > 1e-3, (counts, probs)


def test_speculation_through_preemption(tiny_llama_path, adapters, one_torch_thread):
    """A KV cache too small for the batch preempts requests mid-run (drafts dropped, KV recomputed):
    outputs still equal speculation off."""
    kw = dict(max_total_tokens=64, page_size=4)
    off = sync_engine(server_args(tiny_llama_path, adapters, **kw))
    on = sync_engine(server_args(tiny_llama_path, adapters, speculative_algorithm="ngram", **kw))
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", "a"]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = _run(off, prompts, params, names)
    _with_oracle(on, prompts, want, names)
    assert _run(on, prompts, params, names) == want
    assert on.scheduler.num_preemptions > 0, "no preemption: the test proves nothing"
    assert sum(on.stats().spec_accepted_tokens.values()) > 0


@pytest.mark.parametrize("rate, per_step", [(1.0, 5), (0.0, 1)])
def test_forced_acceptance_sets_the_tokens_per_step(tiny_llama_path, rate, per_step, one_torch_thread):
    """The benchmarks' measurement mode: with every draft forced accepted a decode step emits K+1
    tokens, with none 1 (the step's cost is real, its tokens are not the model's)."""
    engine = sync_engine(server_args(tiny_llama_path, None, speculative_algorithm="ngram"))
    engine.speculator.force_acceptance(rate)
    ids = engine.tokenizer("Once upon a time").input_ids
    engine.add_request("f", ids, SamplingParams(max_new_tokens=21, ignore_eos=True))
    sizes = []
    while engine.has_unfinished():
        sizes.extend(len(out.new_token_ids) for out in engine.step() if out.new_token_ids)
    assert sizes[0] == 1  # the prefill's token
    assert sizes[1:] == [per_step] * (20 // per_step)


def test_speculation_beside_overlap_scheduling(tiny_llama_path, adapters, one_torch_thread):
    """With overlap scheduling on, drafting steps resolve the in-flight step and run without overlap,
    and steps with nothing to draft keep it (the oracle drafts only now and then): outputs still equal
    speculation off, and both kinds of steps ran."""
    off = sync_engine(server_args(tiny_llama_path, adapters))
    on = sync_engine(
        server_args(tiny_llama_path, adapters, speculative_algorithm="ngram", overlap_schedule=True)
    )
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", "a"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = _run(off, prompts, params, names)
    conts = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    full = oracle(conts)
    calls = [0]

    def sometimes(token_ids, k):
        calls[0] += 1
        return full(token_ids, k) if (calls[0] // 8) % 2 else []

    on.speculator.propose = sometimes
    overlapped = [0]
    real = on._step_overlapped

    def counting():
        overlapped[0] += 1
        return real()

    on._step_overlapped = counting
    assert _run(on, prompts, params, names) == want
    assert overlapped[0] > 0, "no overlapped step: the switch is untested"
    assert sum(on.stats().spec_accepted_tokens.values()) > 0


def test_nan_in_a_verify_step_ends_that_request_only(
    tiny_llama_path, adapters, adapter_factory, one_torch_thread
):
    """An adapter whose pages turn NaN after its request's first token (the verify steps are the ones
    that meet it): that request ends with a NonFiniteLogits error, having served only the token before;
    the base and a good adapter in the same verify steps emit what they emit with speculation off."""
    bad = adapter_factory(tiny_llama_path, "spec-nan", r=8, target_modules=["q_proj", "v_proj"], seed=9)
    both = {**adapters, "bad": bad}
    off = sync_engine(server_args(tiny_llama_path, both))
    on = sync_engine(server_args(tiny_llama_path, both, speculative_algorithm="ngram"))
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS[:3]]
    names = [None, "a", "bad"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = _run(off, prompts, params, names)
    _with_oracle(on, prompts, want, names)
    for i, (ids, name) in enumerate(zip(prompts, names, strict=True)):
        on.add_request(f"r{i}", ids, params, name)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    reasons: dict[str, str | None] = {}

    def step() -> None:
        for o in on.step():
            got[o.request_id] += list(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason

    while not got["r2"]:
        step()
    assert len(got["r2"]) == 1  # its first token comes from a plain step: no verify yet
    pool, slot = on.adapter_slots.pool, on.adapter_slots._active["bad"].slot
    pages = torch.tensor(pool.host_pages[slot], dtype=torch.int64)
    for g in pool.lora_b:
        if pool.host_rank[g][:, slot].any():
            pool.lora_b[g][:, pages] = float("nan")
    before = on.stats()
    while on.has_unfinished():
        step()
    assert reasons == {"r0": "length", "r1": "length", "r2": "abort"}, reasons
    assert got["r0"] == want[0] and got["r1"] == want[1]
    assert got["r2"] == want[2][:1]  # nothing computed from the NaN pages was served
    error = on.errors.pop("r2")
    assert type(error).__name__ == "NonFiniteLogits" and error.adapter == "bad", error
    assert not on.errors
    drafted = sum(on.stats().spec_draft_tokens.values()) - sum(before.spec_draft_tokens.values())
    assert drafted > 0  # the steps after the poisoning verified drafts
