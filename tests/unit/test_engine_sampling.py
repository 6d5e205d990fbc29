"""Sampling: seeded reproducibility across batches, filters, penalties, stop strings, detokenization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.detokenizer import IncrementalDetokenizer
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.output import TextStream
from loraplex.services.inference.engine.sampler import SamplingInputs, apply_penalties, sample
from loraplex.services.inference.engine.types import REPETITION_PENALTY_RANGE, SamplingParams
from loraplex.services.inference.errors import InvalidRequest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was", "1, 2, 3,"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path):
    config = EngineConfig(
        model_path=str(tiny_llama_path),
        device=torch.device("cpu"),
        dtype="float32",
        chunked_prefill_size=8,
        max_total_tokens=2048,
        page_size=4,
        context_length=512,
    )
    engine = LLMEngine.from_config(config)
    return engine, [engine.tokenizer(p).input_ids for p in PROMPTS]


def inputs(n: int, **overrides) -> SamplingInputs:
    base = dict(
        temperature=[1.0] * n,
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        repetition_penalty=[1.0] * n,
        frequency_penalty=[0.0] * n,
        presence_penalty=[0.0] * n,
        generators=[torch.Generator().manual_seed(i) for i in range(n)],
        prompt_ids=[[] for _ in range(n)],
        output_ids=[[] for _ in range(n)],
    )
    base.update(overrides)
    return SamplingInputs(**base)


# -- the sampler on its own -------------------------------------------------------------------


def _frequencies(logits_row: list[float], n: int, **overrides) -> torch.Tensor:
    logits = torch.tensor([logits_row] * n)
    tokens = sample(logits, inputs(n, **{k: [v] * n for k, v in overrides.items()}))
    return torch.bincount(torch.tensor(tokens), minlength=len(logits_row)).float() / n


def test_sampled_frequencies_follow_the_filtered_distribution():
    row = [2.0, 1.5, 1.0, 0.0, -1.0]
    probs = torch.tensor(row).softmax(-1)
    n = 4000
    assert torch.allclose(_frequencies(row, n), probs, atol=0.03)
    # temperature 0.5 sharpens: softmax(2x)
    assert torch.allclose(
        _frequencies(row, n, temperature=0.5), (torch.tensor(row) * 2).softmax(-1), atol=0.03
    )
    top2 = _frequencies(row, n, top_k=2)
    assert top2[2:].sum() == 0 and torch.allclose(top2[:2], probs[:2] / probs[:2].sum(), atol=0.03)
    # top_p: the smallest set whose mass reaches p (here the first two: 0.43 + 0.26 >= 0.6)
    top_p = _frequencies(row, n, top_p=0.6)
    assert top_p[2:].sum() == 0 and top_p[1] > 0.2
    # min_p 0.5: tokens with prob >= half the top prob (only the first two)
    min_p = _frequencies(row, n, min_p=0.5)
    assert min_p[2:].sum() == 0 and min_p[1] > 0.2


def test_greedy_and_degenerate_filters_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, inputs(6, temperature=[0.0] * 6)) == argmax
    assert sample(logits, inputs(6, top_k=[1] * 6)) == argmax
    assert sample(logits, inputs(6, min_p=[1.0] * 6)) == argmax
    assert sample(logits, inputs(6, top_p=[1e-6] * 6)) == argmax


def test_tiny_temperatures_are_greedy_not_garbage():
    # logits / 1e-40 overflowed to inf/NaN and argmax answered token 0 whatever the logits.
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 30
    logits[:, 0] = -100.0
    argmax = logits.argmax(-1).tolist()
    for t in (1e-45, 1e-40, 1e-38, 1e-30, 1e-10, 1e-6, float(torch.finfo(torch.float32).tiny)):
        for extra in ({}, {"top_k": [5] * 4}, {"top_p": [0.9] * 4}, {"min_p": [0.1] * 4}):
            assert sample(logits, inputs(4, temperature=[t] * 4, **extra)) == argmax, (t, extra)
    # Just above the threshold it still samples (and, this sharp, takes the argmax anyway).
    assert sample(logits, inputs(4, temperature=[2e-5] * 4)) == argmax


def test_penalties_move_logits_in_the_documented_direction():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rep = apply_penalties(logits, inputs(1, repetition_penalty=[2.0], prompt_ids=[[0]], output_ids=[[1]]))
    # seen tokens lose: positive logits are divided, negative ones multiplied; unseen stay
    assert rep.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    freq = apply_penalties(logits, inputs(1, frequency_penalty=[0.5], output_ids=[[2, 2, 3]]))
    assert freq.tolist() == [[2.0, -2.0, 0.0, 0.0]]
    pres = apply_penalties(logits, inputs(1, presence_penalty=[0.5], output_ids=[[2, 2, 3]]))
    assert pres.tolist() == [[2.0, -2.0, 0.5, 0.0]]
    # negative values encourage repetition
    more = apply_penalties(logits, inputs(1, presence_penalty=[-1.0], output_ids=[[3]]))
    assert more[0, 3] == 1.5


@pytest.mark.parametrize("value", [1e-45, 1e-38, 1e-10, 0.0099, 100.01, 1e30, 3.4e38])
def test_repetition_penalty_outside_its_range_is_refused(value):
    # 1e-38 once divided positive logits to inf: the draw then took token 0 or garbage.
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(repetition_penalty=value).validate()
    assert err.value.field == "sampling_params.repetition_penalty"
    assert "[0.01, 100]" in err.value.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_penalties_at_the_edges_of_their_ranges_keep_logits_finite(dtype):
    low, high = REPETITION_PENALTY_RANGE
    for value in (low, high):
        SamplingParams(repetition_penalty=value).validate()
    logits = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    seen = [list(range(64)) * 64] * 6  # every token, many times: the largest counts a request reaches
    penalised = apply_penalties(
        logits,
        inputs(
            6,
            repetition_penalty=[low, high, low, high, 1.0, 1.0],
            frequency_penalty=[2.0, -2.0, -2.0, 2.0, 2.0, -2.0],
            presence_penalty=[-2.0, 2.0, 2.0, -2.0, -2.0, 2.0],
            prompt_ids=seen,
            output_ids=seen,
        ),
    )
    assert torch.isfinite(penalised).all(), dtype
    greedy = inputs(6, temperature=[0.0] * 6)
    assert sample(penalised.float(), greedy) == penalised.float().argmax(-1).tolist()


# -- through the engine -----------------------------------------------------------------------


def test_seeded_output_is_the_same_in_any_batch(tiny):
    engine, prompts = tiny
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    (alone,) = engine.generate([prompts[0]], seeded)
    others = [
        SamplingParams(max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=30, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=1.5, ignore_eos=True),
    ]
    mixed = engine.generate(
        [prompts[1], prompts[0], prompts[2], prompts[3]], [others[0], seeded, *others[1:]]
    )
    assert mixed[1].token_ids == alone.token_ids
    (again,) = engine.generate([prompts[0]], seeded)
    assert again.token_ids == alone.token_ids
    (other_seed,) = engine.generate([prompts[0]], SamplingParams(**{**seeded.__dict__, "seed": 99}))
    assert other_seed.token_ids != alone.token_ids


def test_top_k_1_equals_greedy(tiny):
    engine, prompts = tiny
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    top1 = engine.generate(
        prompts, SamplingParams(max_new_tokens=16, temperature=1.3, top_k=1, ignore_eos=True)
    )
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def _repeats(tokens: list[int]) -> int:
    return sum(1 for i, t in enumerate(tokens) if t in tokens[:i])


def test_penalties_reduce_repetition_in_generation(tiny):
    engine, prompts = tiny
    params = dict(max_new_tokens=40, ignore_eos=True)
    plain = engine.generate(prompts, SamplingParams(**params))
    freq = engine.generate(prompts, SamplingParams(**params, frequency_penalty=2.0))
    pres = engine.generate(prompts, SamplingParams(**params, presence_penalty=2.0))
    rep = engine.generate(prompts, SamplingParams(**params, repetition_penalty=3.0))
    base = sum(_repeats(r.token_ids) for r in plain)
    assert base > 0  # greedy on a random model loops: there is repetition to remove
    for penalised in (freq, pres, rep):
        assert sum(_repeats(r.token_ids) for r in penalised) < base


def test_stop_strings_cut_the_text_and_are_not_returned(tiny):
    engine, prompts = tiny
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    (full,) = engine.generate([prompts[2]], params)
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    (cut,) = engine.generate(
        [prompts[2]], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop, "\x00never"))
    )
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text
    # the tokens generated up to and including the one completing the stop string
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert len(cut.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_max_new_tokens(tiny):
    engine, prompts = tiny
    (full,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    (stopped,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=12, stop_token_ids=(target,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]


# -- detokenization ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2's tokenizer, loaded once for the detokenization tests (none of them changes it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_streamed_text_never_splits_characters(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "naïve café — 東京タワー 🎉🚀 Ünïcödé ✓ «quotes» and emoji 👩‍👩‍👧 end"
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert sum(1 for d in deltas if d) > 10  # it really streamed


def test_deltas_concatenate_to_full_decode_on_arbitrary_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add(t) for t in ids) + detok.finish()
        assert streamed == tok.decode(ids, skip_special_tokens=True)


def test_text_stream_holds_back_possible_stop_prefixes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stream = TextStream(tok, ("STOP",))
    pieces = []
    stopped = False
    for t in tok("Hello world. Then STOP here please").input_ids:
        stopped = stream.add_token(t)
        pieces.append(stream.take(stopped))
        if stopped:
            break
    assert stopped
    assert "".join(pieces) == "Hello world. Then "


def test_min_tokens_masks_stop_tokens_until_reached(tiny):
    engine, prompts = tiny
    (full,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    target = full.token_ids[1]
    first = full.token_ids.index(target)
    (early,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=12, stop_token_ids=(target,)))
    assert early.finish_reason == "stop" and len(early.token_ids) == first + 1
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(target, 10**9), min_tokens=first + 3)
    (late,) = engine.generate([prompts[0]], params)
    assert len(late.token_ids) >= first + 3
    assert target not in late.token_ids[: first + 3]
    assert late.finish_reason == "length" or late.token_ids[-1] == target
    with pytest.raises(Exception, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5).validate()


def test_ban_masks_only_the_named_ids():
    logits = torch.zeros(2, 6)
    logits[0, 3] = logits[1, 2] = 5.0
    got = sample(logits, inputs(2, temperature=[0.0, 0.0], banned=[(3,), ()]))
    assert got[1] == 2 and got[0] != 3


def test_special_tokens_kept_when_asked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("hi").input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    for skip, want in ((True, "hi"), (False, "hi<|im_end|>")):
        stream = TextStream(tok, (), skip)
        for t in ids:
            stream.add_token(t)
        stream.finish()
        assert stream.take(True) == want


def test_token_bytes_rebuild_the_text(smollm2_tokenizer):
    """Byte-level pieces of one character keep their bytes (decoded alone they are U+FFFD)."""
    from loraplex.services.inference.engine.token_bytes import TokenBytes

    tok = smollm2_tokenizer
    text = "hi 😀 there é 東京 👩‍👩‍👧<|im_end|>"
    ids = tok(text).input_ids
    raw = TokenBytes(tok)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the case this is for
    assert b"".join(raw(t) for t in ids) == text.encode()
    assert len({raw(t) for t in ids if "\ufffd" in tok.decode([t])}) > 1  # not all the same replacement
