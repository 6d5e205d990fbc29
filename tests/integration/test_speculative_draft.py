"""`--speculative-algorithm draft`: a draft model proposes, the target verifies. Greedy outputs equal
speculation off (base and adapters in one batch), the target as its own draft accepts nearly every
token, sampled outputs follow the target's distribution with a real draft distribution q, and a draft
model of another vocabulary is refused at start."""

from __future__ import annotations

import math

import pytest

from loraplex.services.inference.engine.draft_runner import DraftModelMismatch
from loraplex.services.inference.engine.types import SamplingParams
from tests.support.chi_square import chi_square_p
from tests.support.factories import make_tiny_model
from tests.support.lora_reference import server_args, sync_engine

PROMPTS = [
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "the cat sat on the mat. the cat sat on the",
    "def f(x): return x\ndef g(x): return",
    "Hello Hello Hello Hello",
]


@pytest.fixture(scope="module")
def small_draft_path(tmp_path_factory, smollm2_path):
    """A 1-layer random model with the target's tokenizer: a draft that is mostly wrong."""
    return make_tiny_model(
        tmp_path_factory.mktemp("draft-1l"), num_layers=1, tokenizer_from=smollm2_path, seed=7
    )


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    return {
        "a": adapter_factory(tiny_llama_path, "dspec-a", r=8, target_modules=["q_proj", "v_proj"], seed=3),
        "b": adapter_factory(tiny_llama_path, "dspec-b", r=4, target_modules=["o_proj", "down_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def off(tiny_llama_path, adapters):
    return sync_engine(server_args(tiny_llama_path, adapters))


def _draft_engine(target, adapters, draft, **kw):
    return sync_engine(
        server_args(
            target, adapters, speculative_algorithm="draft", speculative_draft_model_path=str(draft), **kw
        )
    )


def _spec_counts(engine) -> tuple[dict[str, int], dict[str, int]]:
    stats = engine.stats()
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


def test_self_draft_accepts_nearly_everything_and_equals_speculation_off(
    tiny_llama_path, adapters, off, one_torch_thread
):
    """The target as its own draft: base requests accept (nearly) every draft token, and greedy
    outputs of base and adapter requests in one batch equal speculation off, with log probabilities."""
    on = _draft_engine(tiny_llama_path, adapters, tiny_llama_path)
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", None]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)
    want = off.generate(prompts, params, names)
    got = on.generate(prompts, params, names)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    drafted, accepted = _spec_counts(on)
    assert drafted[""] > 20, drafted
    assert accepted[""] / drafted[""] >= 0.95, (accepted, drafted)
    # The adapters move the target away from the (base) draft: their requests drafted too.
    assert {"a", "b"} <= set(drafted)


def test_small_draft_greedy_equals_speculation_off(tiny_llama_path, adapters, off, small_draft_path):
    """A draft model unlike the target (rejections everywhere), a page size that makes the draft's KV
    cross pages, chunked catch-up of prompts longer than the step budget: outputs equal."""
    on = _draft_engine(tiny_llama_path, adapters, small_draft_path, page_size=4, max_num_batched_tokens=16)
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", "a"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in off.generate(prompts, params, names)]
    assert [o.token_ids for o in on.generate(prompts, params, names)] == want
    drafted, _ = _spec_counts(on)
    assert sum(drafted.values()) > 0
    # Finished requests hand their draft KV back.
    on.speculator.speculates([])
    assert on.speculator.draft_runner.blocks.num_free_blocks == on.speculator.draft_runner.blocks.num_blocks


def test_sampled_outputs_follow_the_targets_distribution(tiny_llama_path, adapters, off, one_torch_thread):
    """Seeded sampled requests (top_k 4) with adapter "a", drafted by the base model (so q, the
    draft's distribution, differs from the target's p but overlaps it): the second token, drafted from
    q and verified against p, passes a chi-square test against the target's top-4 distribution after
    the most common first token; drafts were both accepted and rejected."""
    kw = dict(max_num_batched_tokens=4096, chunked_prefill_size=4096, max_running_requests=1024)
    on = _draft_engine(tiny_llama_path, adapters, tiny_llama_path, speculative_disable_batch_size=4096, **kw)
    prompt = on.tokenizer("Once upon a time").input_ids
    # max_new_tokens 4: each request's first verification drafts 2 tokens, and a later step always has
    # a request with room to draft (a step with none would pause speculation for a few steps)
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, top_k=4, seed=s) for s in range(400)]
    off.add_request("p", prompt, SamplingParams(max_new_tokens=1, logprobs=4), "a")
    top = []
    while off.has_unfinished():
        for out in off.step():
            top = out.logprobs[0].top if out.logprobs else top
    t1 = top[0][0]
    target = {}
    off.add_request("q", prompt + [t1], SamplingParams(max_new_tokens=1, logprobs=4), "a")
    while off.has_unfinished():
        for out in off.step():
            target = dict(out.logprobs[0].top) if out.logprobs else target
    norm = sum(math.exp(v) for v in target.values())
    probs = {t: math.exp(v) / norm for t, v in target.items()}
    outs = on.generate([prompt] * len(params), params, ["a"] * len(params))
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == t1]
    assert len(seconds) > 100, len(seconds)
    drafted, accepted = _spec_counts(on)
    assert drafted["a"] >= 2 * len(params) and 0 < accepted["a"] < drafted["a"], (drafted, accepted)
    counts = [seconds.count(t) for t in probs]
    assert sum(counts) == len(seconds), "a token outside the target's top 4 was emitted"
    assert chi_square_p(counts, list(probs.values())) > 1e-3, (counts, probs)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama_path, tmp_path):
    other = make_tiny_model(tmp_path / "v256", num_layers=1, vocab_size=256)
    with pytest.raises(DraftModelMismatch, match="--speculative-draft-model-path .* vocabulary of 256"):
        _draft_engine(tiny_llama_path, None, other)


def test_draft_flags_are_checked_together():
    with pytest.raises(
        ValueError, match="--speculative-draft-lora-paths needs --speculative-algorithm draft"
    ):
        server_args("m", None, speculative_draft_lora_paths=("d=x",))
    with pytest.raises(ValueError, match="--speculative-draft-model-path is needed"):
        server_args("m", None, speculative_algorithm="draft")
    with pytest.raises(ValueError, match="--speculative-draft-model-path is needed"):
        server_args("m", None, speculative_algorithm="ngram", speculative_draft_model_path="d")


def test_draft_adapters_batched_in_one_draft_step(tiny_llama_path, adapters, off, one_torch_thread):
    """The target as its own draft, with the target's adapters as draft adapters: requests whose
    draft adapter is their target adapter accept (nearly) every draft token, with two different draft
    adapters and none in the same draft steps, and greedy outputs equal speculation off."""
    draft_paths = tuple(f"d{name}={path}" for name, path in adapters.items())
    on = _draft_engine(tiny_llama_path, adapters, tiny_llama_path, speculative_draft_lora_paths=draft_paths)
    assert set(on.speculator.draft_runner.adapter_slots) == {"da", "db"}
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS[:3]]
    names, drafts = [None, "a", "b"], [None, "da", "db"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in off.generate(prompts, params, names)]
    assert [o.token_ids for o in on.generate(prompts, params, names, drafts)] == want
    drafted, accepted = _spec_counts(on)
    for name in ("", "a", "b"):
        assert drafted[name] > 10 and accepted[name] / drafted[name] >= 0.95, (name, drafted, accepted)


def test_unknown_draft_adapters_are_refused(tiny_llama_path, adapters, off):
    from loraplex.services.inference.errors import AdapterNotFound, InvalidRequest

    prompt = off.tokenizer("hi").input_ids
    with pytest.raises(InvalidRequest, match="draft_adapter 'x': this server has no draft adapters") as exc:
        off.generate([prompt], SamplingParams(max_new_tokens=1), None, ["x"])
    assert exc.value.field == "draft_adapter"
    draft_paths = (f"da={adapters['a']}",)
    on = _draft_engine(tiny_llama_path, adapters, tiny_llama_path, speculative_draft_lora_paths=draft_paths)
    with pytest.raises(AdapterNotFound, match="draft_adapter 'x' is not one of .* \\(da\\)"):
        on.generate([prompt], SamplingParams(max_new_tokens=1), None, ["x"])


def test_draft_adapter_over_grpc(tiny_llama_path, adapters):
    """The flags as the server reads them, and `draft_adapter` on a Generate request (for all inputs,
    or one input's own): greedy outputs equal the same call without draft adapters; an unknown name
    is NOT_FOUND naming it."""
    import grpc

    from loraplex.v1 import inference_pb2 as pb
    from loraplex.v1 import inference_pb2_grpc as pb_grpc
    from tests.support.service_stack import start_inference

    proc = start_inference(
        tiny_llama_path,
        "--lora-paths",
        f"a={adapters['a']}",
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model-path",
        str(tiny_llama_path),
        "--speculative-draft-lora-paths",
        f"da={adapters['a']}",
        f"db={adapters['b']}",
    )
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            params = pb.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)

            def call(draft: str, per_input: tuple[str, str] = ("", "")):
                inputs = [
                    pb.Input(text=t, draft_adapter=d) for t, d in zip(PROMPTS[:2], per_input, strict=True)
                ]
                req = pb.GenerateRequest(
                    inputs=inputs, adapter=["a"], sampling_params=params, draft_adapter=draft
                )
                return [list(c.token_ids) for c in stub.Generate(req).completions]

            plain = call("")
            assert call("da") == plain
            assert call("da", ("", "db")) == plain
            with pytest.raises(grpc.RpcError) as info:
                call("nope")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "draft_adapter 'nope'" in info.value.details()
    finally:
        proc.stop()


def test_draft_model_beside_overlap_scheduling(tiny_llama_path, adapters, off, one_torch_thread):
    """Overlap scheduling on and speculation off above 2 running requests: the first steps overlap
    (placeholder tokens in flight), then, once two requests are done, the draft model catches up on
    everything the others wrote meanwhile and drafts. Outputs equal speculation off; both kinds of
    steps ran."""
    on = _draft_engine(
        tiny_llama_path, adapters, tiny_llama_path, overlap_schedule=True, speculative_disable_batch_size=2
    )
    prompts = [off.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", None]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 9, 24, 24)]
    want = [o.token_ids for o in off.generate(prompts, params, names)]
    overlapped = [0]
    real = on._step_overlapped

    def counting():
        overlapped[0] += 1
        return real()

    on._step_overlapped = counting
    assert [o.token_ids for o in on.generate(prompts, params, names)] == want
    drafted, accepted = _spec_counts(on)
    assert overlapped[0] > 0 and accepted[""] > 0, (overlapped, drafted, accepted)


def test_draft_adapters_must_be_local_directories(tiny_llama_path, tmp_path):
    with pytest.raises(
        ValueError, match="--speculative-draft-lora-paths da=.*: not a local adapter directory"
    ):
        _draft_engine(
            tiny_llama_path, None, tiny_llama_path, speculative_draft_lora_paths=(f"da={tmp_path}/none",)
        )


def test_draft_model_through_preemption(tiny_llama_path, adapters, one_torch_thread):
    """A KV cache too small for the batch (the draft's as small): requests are preempted mid-run and
    their draft state dropped and caught up again, and drafts that do not fit are skipped; outputs
    equal speculation off."""
    kw = dict(max_total_tokens=64, page_size=4)
    off_small = sync_engine(server_args(tiny_llama_path, adapters, **kw))
    on = _draft_engine(tiny_llama_path, adapters, tiny_llama_path, **kw)
    prompts = [off_small.tokenizer(p).input_ids for p in PROMPTS]
    names = [None, "a", "b", None]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in off_small.generate(prompts, params, names)]
    assert [o.token_ids for o in on.generate(prompts, params, names)] == want
    assert on.scheduler.num_preemptions > 0, "no preemption: the test proves nothing"
    assert _spec_counts(on)[1][""] > 0
