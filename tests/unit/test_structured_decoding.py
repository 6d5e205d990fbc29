"""Constrained decoding (engine/grammar.py) in the engine, on the tiny random Llama with SmolLM2's
tokenizer: a random model is the hard case (it never "wants" to follow a format), so every
finished output parsing and validating here is the mask's doing. JSON schemas, any JSON object,
regex, choice and EBNF; greedy and sampled; mixed with free-text rows and an adapter; with and
without overlap scheduling; compile errors, limits and the grammar cache."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from loraplex.bench.random_schemas import random_schema
from loraplex.services.inference.engine.grammar_cache import GrammarCache
from loraplex.services.inference.engine.types import MAX_CONSTRAINT_CHARS, Constraint, SamplingParams
from loraplex.services.inference.errors import InvalidRequest
from tests.support.lora_reference import server_args, sync_engine

NUM_SCHEMAS = 12
MAX_TOKENS = 160


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def engines(tiny_llama_path, adapter_factory):
    adapter = adapter_factory(
        tiny_llama_path, "st-r4", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    return {
        overlap: sync_engine(server_args(tiny_llama_path, {"r4": adapter}, overlap_schedule=overlap))
        for overlap in (False, True)
    }


def _params(constraint: Constraint | None, temperature: float, seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=MAX_TOKENS, temperature=temperature, seed=seed, constraint=constraint, **kw
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_random_schemas_validate_in_a_mixed_batch(engines, overlap):
    engine = engines[overlap]
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    prompt = engine.tokenizer("Answer in JSON:").input_ids
    params, adapters = [], []
    for i, schema in enumerate(schemas):
        c = Constraint("json_schema", json.dumps(schema))
        params.append(_params(c, temperature=0.0 if i % 2 else 1.0, seed=i))
        adapters.append("r4" if i % 3 == 0 else None)
    # Free-text rows in the same batch, with and without the adapter.
    params += [_free(16), _free(16)]
    adapters += [None, "r4"]
    outs = engine.generate([prompt] * len(params), params, adapters)
    stopped = 0
    for schema, out in zip(schemas, outs, strict=False):
        if out.finish_reason == "length":
            assert len(out.token_ids) == MAX_TOKENS
            continue
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
        stopped += 1
    assert stopped >= NUM_SCHEMAS * 3 // 4, [o.finish_reason for o in outs]
    for free in outs[NUM_SCHEMAS:]:
        assert free.finish_reason in ("stop", "length")
    assert engine.output_processor.num_constrained == 0


def _free(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def test_free_rows_are_unchanged_by_constrained_neighbours(engines):
    """A free row's greedy output is the same alone and beside constrained rows."""
    engine = engines[True]
    prompt = engine.tokenizer("Once upon a time").input_ids
    alone = engine.generate([prompt], _free(12))[0]
    c = Constraint("json_object")
    mixed = engine.generate([prompt, prompt, prompt], [_free(12), _params(c, 0.0, 0), _params(c, 1.0, 1)])
    assert mixed[0].token_ids == alone.token_ids
    for out in mixed[1:]:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("overlap", [False, True])
def test_regex_choice_and_grammar(engines, overlap):
    engine = engines[overlap]
    prompt = engine.tokenizer("Pick:").input_ids
    choices = ("yes", "no", "it depends")
    regex = r"[A-Z][a-z]{2,5}-[0-9]{2}"
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [
        (Constraint("choice", choices=choices), lambda t: t in choices),
        (Constraint("regex", regex), lambda t: re.fullmatch(regex, t) is not None),
        (Constraint("grammar", grammar), lambda t: re.fullmatch(r"\(\d{1,2}( \+ \d{1,2})*\)", t) is not None),
    ]
    params = [_params(c, temp, seed) for c, _ in cases for temp, seed in ((0.0, 0), (1.0, 5), (1.5, 6))]
    outs = engine.generate([prompt] * len(params), params, ["r4", None, None] * len(cases))
    for i, out in enumerate(outs):
        check = cases[i // 3][1]
        if out.finish_reason == "stop":
            assert check(out.text), (i, out.text)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
    # Choice and the fixed-length regex cannot run to the length limit.
    assert all(o.finish_reason == "stop" for o in outs[:6])


def test_logprobs_are_the_models_before_the_mask(engines):
    engine = engines[False]
    prompt = engine.tokenizer("Pick:").input_ids
    out_lp = {}

    params = SamplingParams(max_new_tokens=4, logprobs=2, constraint=Constraint("choice", choices=("no",)))
    engine.add_request("lp", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            out_lp.setdefault(out.request_id, []).extend(out.logprobs or [])
    first = out_lp["lp"][0]
    # The forced token is rarely the model's favourite; its log-prob is the model's, finite and < 0,
    # and the alternatives reported are the unmasked top tokens.
    assert first.logprob < 0
    assert first.top[0][1] >= first.logprob


def test_invalid_constraints_name_the_field(engines):
    grammars: GrammarCache = engines[False].grammars
    bad = [
        (Constraint("json_schema", "{not json"), "sampling_params.json_schema", "not valid JSON"),
        (Constraint("json_schema", '{"type": "objectx"}'), "sampling_params.json_schema", "objectx"),
        (Constraint("regex", "[a-"), "sampling_params.regex", "Unclosed"),
        (Constraint("grammar", "root ::= foo"), "sampling_params.grammar", "foo"),
        (Constraint("choice", choices=()), "sampling_params.choice", "1-1024"),
        (Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)), "sampling_params.regex", "at most"),
    ]
    for c, field, words in bad:
        with pytest.raises(InvalidRequest, match=words) as err:
            grammars.compile(c)
        assert err.value.field == field
        assert "cpp" not in err.value.message  # the parser's message, not its source location


def test_compile_is_cached_and_slow_compiles_are_refused(engines, tiny_llama_path):
    grammars: GrammarCache = engines[False].grammars
    c = Constraint("regex", "[a-c]{3}")
    first = grammars.compile(c)
    assert grammars.cached(c) and grammars.compile(c) is first
    # Bounded: the least recently used grammar goes first.
    small = GrammarCache(engines[False].tokenizer, grammars.vocab_size, [2], max_entries=2)
    regexes = [Constraint("regex", r) for r in ("a+", "b+", "c+")]
    for r in regexes:
        small.compile(r)
    assert [small.cached(r) for r in regexes] == [False, True, True]
    small.close()
    # A compile slower than the limit is refused with a clear error, then refused at once.
    slow = GrammarCache(
        engines[False].tokenizer, engines[False].grammars.vocab_size, [2], compile_timeout_s=0.0
    )
    hard = Constraint("regex", "(a|b)*c{0,30}d{0,30}")
    with pytest.raises(InvalidRequest, match="longer than 0 s to compile") as err:
        slow.compile(hard)
    assert err.value.field == "sampling_params.regex"
    with pytest.raises(InvalidRequest, match="longer than"):
        slow.submit(hard)
    slow.close()


def test_any_json_object_bounds_numbers(engines):
    """A small model may write digits for ever; "any JSON object" ends a number after 16 digits."""
    import xgrammar as xgr

    compiled = engines[False].grammars.compile(Constraint("json_object"))

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return m.accept_string(text) and m.is_completed()

    assert accepts('{"a": [1, -2.5e3, "x\\n\\u00e9", {"b": null}], "c": true}') and accepts("{}")
    assert accepts('{"n": ' + "9" * 16 + "}")
    assert not accepts('{"n": ' + "9" * 17 + "}")
    assert not accepts('{"a":1}')  # one space after ":" and ",", no other whitespace


def test_a_stop_string_is_the_callers_cut(engines):
    """A stop string ends a constrained output early, as the caller asked ("stop", text before it)."""
    engine = engines[True]
    prompt = engine.tokenizer("Code:").input_ids
    params = SamplingParams(max_new_tokens=20, stop=(",",), constraint=Constraint("regex", "abc,def"))
    out = engine.generate([prompt], params)[0]
    assert (out.text, out.finish_reason) == ("abc", "stop")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_dead_end_is_an_error_never_ok(engines, overlap, temperature):
    """A grammar that admits its first token and then nothing, and min_tokens past the end of a
    grammar, leave no token to sample: the request fails naming the field (it used to end "abort"
    with status OK and token 0). Its free-text neighbour in the batch runs on unharmed."""
    engine = engines[overlap]
    prompt = engine.tokenizer("Answer:").input_ids
    cases = [
        (_params(Constraint("grammar", 'root ::= "a" rest\nrest ::= rest'), temperature, 1), "grammar"),
        (_params(Constraint("choice", choices=("yes", "no")), temperature, 2, min_tokens=5), "min_tokens"),
    ]
    for params, field in cases:
        free = _free(8)
        for rid, p in (("dead", params), ("free", free)):
            engine.add_request(rid, prompt, p)
        done = {}
        while len(done) < 2:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert done["dead"].finish_reason == "abort"
        error = engine.errors.pop("dead")
        assert isinstance(error, InvalidRequest) and error.field == f"sampling_params.{field}", error
        assert done["free"].finish_reason in ("stop", "length") and "free" not in engine.errors
    assert engine.output_processor.num_constrained == 0
