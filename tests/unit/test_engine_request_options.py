"""The per-request options clients port from OpenAI and vLLM, in the engine: logit_bias,
allowed_token_ids, bad_words, include_stop_str_in_output, priority, cache_salt, any-whitespace JSON."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.chat import (
    check_template_kwargs,
    continue_final,
    render_model_template,
)
from loraplex.services.inference.engine.config import EngineConfig, SchedulerConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.grammar_cache import constraint_digest
from loraplex.services.inference.engine.output import TextStream
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import SamplingInputs, sample
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.types import Constraint, SamplingParams
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.lora.adapter_slots import NoAdapters

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def tiny(tiny_llama_path: Path):
    config = EngineConfig(
        model_path=str(tiny_llama_path),
        device=torch.device("cpu"),
        dtype="float32",
        chunked_prefill_size=16,
        max_total_tokens=1024,
        page_size=4,
        context_length=256,
    )
    engine = LLMEngine.from_config(config)
    return engine, engine.tokenizer("The capital of France is").input_ids


def _inputs(n: int, **kw) -> SamplingInputs:
    base = dict(
        temperature=[0.0] * n,
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        repetition_penalty=[1.0] * n,
        frequency_penalty=[0.0] * n,
        presence_penalty=[0.0] * n,
        generators=[None] * n,
        prompt_ids=[[]] * n,
        output_ids=[[]] * n,
    )
    return SamplingInputs(**(base | kw))


def test_bias_and_allowed_ids_touch_only_the_rows_that_ask():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    bias = [((0, 10.0),), (), ((3, -100.0), (3, 0.5))]  # row 2: the same id twice adds up
    assert sample(logits, _inputs(3, bias=bias)) == [0, 3, 2]
    assert sample(logits, _inputs(3, allowed=[(1, 2), (), (0,)])) == [2, 3, 0]
    # both: the bias moves the logits, the allowed ids decide which of them can win
    assert sample(logits[:1], _inputs(1, bias=[((1, 5.0),)], allowed=[(1, 2)])) == [1]
    assert sample(logits[:1], _inputs(1, bias=[((3, 5.0),)], allowed=[(1, 2)])) == [2]


def test_logit_bias_steers_the_engine_and_is_checked(tiny):
    engine, prompt = tiny
    free = engine.generate([prompt], GREEDY)[0].token_ids
    target = free[0] + 1
    forced = engine.generate([prompt], dataclasses.replace(GREEDY, logit_bias=((target, 100.0),)))[0]
    assert forced.token_ids == [target] * len(free)
    banned = engine.generate([prompt], dataclasses.replace(GREEDY, logit_bias=((free[0], -100.0),)))[0]
    assert banned.token_ids[0] != free[0]
    for bad, field in (
        (dataclasses.replace(GREEDY, logit_bias=((1, 101.0),)), "sampling_params.logit_bias"),
        (dataclasses.replace(GREEDY, logit_bias=((10**7, 1.0),)), "sampling_params.logit_bias"),
        (dataclasses.replace(GREEDY, allowed_token_ids=(10**7,)), "sampling_params.allowed_token_ids"),
    ):
        with pytest.raises(InvalidRequest) as info:
            engine.check_request(prompt, bad)
        assert info.value.field == field


def test_allowed_token_ids_and_bad_words(tiny):
    engine, prompt = tiny
    allowed = (5, 17, 300)
    out = engine.generate([prompt], dataclasses.replace(GREEDY, allowed_token_ids=allowed))[0]
    assert set(out.token_ids) <= set(allowed)
    free = engine.generate([prompt], GREEDY)[0].token_ids
    # a two-token bad word made of the free output's 2nd and 3rd tokens: the 3rd can no longer follow
    word = (free[1], free[2])
    out = engine.generate([prompt], dataclasses.replace(GREEDY, bad_words_ids=(word,)))[0].token_ids
    assert out[:2] == free[:2] and out[2] != free[2]
    assert all(out[i : i + 2] != list(word) for i in range(len(out) - 1))
    single = engine.generate([prompt], dataclasses.replace(GREEDY, bad_words_ids=((free[0],),)))[0]
    assert free[0] not in single.token_ids


def test_include_stop_str_in_output(tiny_llama_path, tiny):
    engine, prompt = tiny
    free = engine.generate([prompt], GREEDY)[0]
    stop = free.text[3:6]
    assert stop and free.text.find(stop) == 3
    cut = engine.generate([prompt], dataclasses.replace(GREEDY, stop=(stop,)))[0].text
    kept = engine.generate(
        [prompt], dataclasses.replace(GREEDY, stop=(stop,), include_stop_str_in_output=True)
    )[0]
    assert cut == free.text[:3] and kept.text == free.text[:6]
    stream = TextStream(engine.tokenizer, ("b",), include_stop=True)
    stream.detokenizer.add = lambda t: "aab" if t == 1 else "c"  # the stream's cut, without a model
    assert stream.add_token(1) and stream.take(True) == "aab"


def test_priority_orders_the_waiting_queue():
    scheduler = Scheduler(SchedulerConfig(4, 32, 8, 4, context_length=256), BlockManager(64, 4), NoAdapters())
    reqs = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(priority=p)) for i, p in enumerate((0, 5, -1, 0, 5, -1))
    ]
    for r in reqs:
        scheduler.add(r)
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r5", "r0", "r3", "r1", "r4"]


def test_cache_salt_isolates_the_prefix_cache(tiny):
    engine, _ = tiny
    prompt = list(range(10, 50))  # 10 full pages
    salted = dataclasses.replace(GREEDY, max_new_tokens=1, cache_salt="tenant-a")

    def cached(params: SamplingParams) -> int:
        before = dict(engine.stats().prefix_cache_hit_tokens)
        engine.generate([prompt], params)
        return engine.stats().prefix_cache_hit_tokens.get("", 0) - before.get("", 0)

    plain = dataclasses.replace(GREEDY, max_new_tokens=1)
    cached(plain)
    assert cached(plain) > 0  # the cache is on and reuses the prompt
    assert cached(salted) == 0  # a salt never sees unsalted blocks
    assert cached(salted) > 0  # ... but its own
    assert cached(dataclasses.replace(salted, cache_salt="tenant-b")) == 0


def test_any_whitespace_is_its_own_grammar(tiny):
    import xgrammar as xgr

    engine, _ = tiny
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    spaced = '{\n  "a" :  1\n}'
    for kind, value in (("json_schema", schema), ("json_object", "")):
        compact = Constraint(kind, value)
        loose = Constraint(kind, value, any_whitespace=True)
        assert constraint_digest(compact) != constraint_digest(loose)
        assert xgr.GrammarMatcher(engine.grammars.compile(loose)).accept_string(spaced)
        assert not xgr.GrammarMatcher(engine.grammars.compile(compact)).accept_string(spaced)
        assert xgr.GrammarMatcher(engine.grammars.compile(compact)).accept_string('{"a": 1}')


def test_template_kwargs_reach_the_template_and_continue_final_message(tiny):
    engine, _ = tiny
    tok = engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    try:
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
        off = render_model_template(tok, msgs[:1], True, None, {"enable_thinking": False})
        assert off == "<user>hi</user>[no-think]<assistant>"
        assert render_model_template(tok, msgs[:1], True) == "<user>hi</user><assistant>"
        text = render_model_template(tok, msgs, False)
        assert continue_final(text, msgs) == "<user>hi</user><assistant>Once upon"
    finally:
        tok.chat_template = saved
    with pytest.raises(InvalidRequest):
        check_template_kwargs({"add_generation_prompt": True})
    check_template_kwargs({"enable_thinking": False})
