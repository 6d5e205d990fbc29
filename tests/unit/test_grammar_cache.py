"""The grammar compile pool and cache (engine/compile_pool.py, engine/grammar_cache.py) on the real
xgrammar with SmolLM2's tokenizer. A compile is made slow on purpose by a compile function that
holds named constraints until the test lets them go (then compiles them for real): the pool's
scheduling is what is under test, and the waits are events, not sleeps that a loaded CI machine
could stretch."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from loraplex.services.inference.engine import grammar_cache
from loraplex.services.inference.engine.grammar_cache import GrammarCache
from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import CapacityExceeded, InvalidRequest

SIMPLE = Constraint("regex", "[a-c]{3}")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    """SmolLM2's tokenizer, with xgrammar's compiler on it built once for the module's caches."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.xgr_compiler = GrammarCache(tok, len(tok), [2]).prepare()
    return tok


class Held:
    """A compile function: regexes starting "held" wait for `release` (then compile for real);
    `started` lists the constraints whose compile began."""

    def __init__(self):
        self.release = threading.Event()
        self.started: list[str] = []
        self.cache: GrammarCache | None = None

    def __call__(self, c: Constraint, own=None):
        self.started.append(c.value)
        if c.value.startswith("held"):
            assert self.release.wait(30), "the test never released its held compiles"
        return self.cache._xgr_compile(c, own)


def _cache(tokenizer, held: Held | None = None, **kw) -> GrammarCache:
    # The tokenizer table, built once, is no compile's time.
    cache = GrammarCache(
        tokenizer, len(tokenizer), [2], compile_fn=held, compiler=tokenizer.xgr_compiler, **kw
    )
    if held is not None:
        held.cache = cache
    return cache


def _wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def test_the_time_limit_measures_the_compile_not_the_queue(tokenizer):
    """Behind two slow compiles (both workers busy past the limit), a simple constraint waits for
    a worker and then compiles: its wait is not its compile time, and it is not refused."""
    held = Held()
    cache = _cache(tokenizer, held, compile_timeout_s=0.5)
    try:
        slow = [cache.submit(Constraint("regex", f"held{i}"), owner=f"caller{i}") for i in range(2)]
        _wait_for(lambda: len(held.started) == 2)
        assert cache.compile(SIMPLE, owner="other") is not None
        # It could only start once a held compile passed its limit and gave its worker back: it
        # waited in the queue (the old pool counted that wait and refused it). The other held one
        # may still be short of its own limit (it started later), so one refusal is what is certain.
        assert any(job.future.done() for job in slow) and not held.release.is_set()
        for job in slow:  # the slow ones are refused for their own time ...
            with pytest.raises(InvalidRequest, match="longer than 0.5 s to compile"):
                job.future.result(timeout=5)
        with pytest.raises(InvalidRequest, match="longer than"):  # ... and at once from then on
            cache.submit(Constraint("regex", "held0"))
        assert cache.cached(SIMPLE) and cache.compile(SIMPLE) is cache.compile(SIMPLE)
    finally:
        held.release.set()
        cache.close()


def test_a_refusal_for_load_is_not_kept(tokenizer):
    """A caller that waited too long for a worker is told to retry (RESOURCE_EXHAUSTED), and the
    same constraint compiles once the worker is free."""
    held = Held()
    cache = _cache(tokenizer, held, compile_timeout_s=30, queue_timeout_s=0.3, workers=1)
    try:
        cache.submit(Constraint("regex", "held"), owner="slow caller")
        _wait_for(lambda: held.started == ["held"])
        with pytest.raises(CapacityExceeded, match="waited 0.3 s for a grammar compiler") as err:
            cache.compile(SIMPLE, owner="other")
        assert err.value.field == "sampling_params.regex"
        assert held.started == ["held"]  # the refused caller's queued compile was dropped
        held.release.set()
        assert cache.compile(SIMPLE, owner="other") is not None
    finally:
        held.release.set()
        cache.close()


def test_one_caller_cannot_take_every_worker(tokenizer):
    """A caller with three slow constraints runs one compile at a time; another caller's simple
    constraint passes its queued ones and compiles on the other worker at once."""
    held = Held()
    cache = _cache(tokenizer, held, compile_timeout_s=30)
    try:
        for i in range(3):
            cache.submit(Constraint("regex", f"held{i}"), owner="greedy")
        _wait_for(lambda: held.started == ["held0"])
        assert cache.compile(SIMPLE, owner="polite") is not None
        assert held.started == ["held0", SIMPLE.value]  # greedy's others still wait their turn
    finally:
        held.release.set()
        cache.close()


def test_a_cancelled_waiter_cancels_only_itself(tokenizer):
    """Callers that leave while their compile is queued (the client went away) do not break the
    compile for anyone else: neither a caller waiting on the same constraint nor a later one."""
    held = Held()
    cache = _cache(tokenizer, held, compile_timeout_s=30, workers=1)
    left, stays = Constraint("regex", "[x-z]{2}"), Constraint("regex", "[d-f]{2}")

    async def scenario():
        blocker = asyncio.create_task(cache.compile_async(Constraint("regex", "held"), "a"))
        await asyncio.to_thread(_wait_for, lambda: held.started == ["held"])
        alone = asyncio.create_task(cache.compile_async(left, "b"))
        shared = [asyncio.create_task(cache.compile_async(stays, owner)) for owner in ("c", "d")]
        await asyncio.sleep(0.05)
        alone.cancel()
        shared[0].cancel()
        await asyncio.gather(alone, shared[0], return_exceptions=True)
        held.release.set()
        assert await shared[1] is not None  # the other waiter of the same compile still gets it
        assert await blocker is not None
        # A later caller of the constraint whose only waiter left compiles it afresh.
        assert await cache.compile_async(left, "e") is not None

    try:
        asyncio.run(scenario())
        assert held.started.count(left.value) == 1  # compiled once: by the later caller
    finally:
        held.release.set()
        cache.close()


def test_the_cache_is_bounded_by_bytes(tokenizer):
    regexes = [Constraint("regex", f"[a-c]{{0,{n}}}x") for n in (20, 21, 22)]
    probe = _cache(tokenizer)
    sizes = [probe.compile(r).memory_size_bytes for r in regexes]
    probe.close()
    assert min(sizes) > 10_000  # real token masks, measured by xgrammar
    cache = _cache(tokenizer, max_bytes=sizes[1] + sizes[2])
    try:
        for r in regexes:
            cache.compile(r)
        assert [cache.cached(r) for r in regexes] == [False, True, True]  # least recently used left
        assert cache.bytes_held == sizes[1] + sizes[2] <= cache.max_bytes
    finally:
        cache.close()


def test_a_grammar_over_the_size_bound_is_refused_and_not_kept(tokenizer):
    cache = _cache(tokenizer, max_grammar_bytes=4096)
    try:
        big = Constraint("regex", "[a-c]{0,20}x")
        with pytest.raises(InvalidRequest, match=r"compiles to .* MiB of token masks; at most") as err:
            cache.compile(big)
        assert err.value.field == "sampling_params.regex"
        assert not cache.cached(big) and cache.bytes_held == 0
        assert cache.compile(Constraint("choice", choices=("yes", "no"))) is not None  # small ones pass
    finally:
        cache.close()


def test_a_compile_refused_as_too_slow_keeps_nothing(tokenizer, monkeypatch):
    held = Held()
    cache = _cache(tokenizer, held, compile_timeout_s=0.2)
    try:
        slow = Constraint("regex", "held[a-c]{0,20}")
        with pytest.raises(InvalidRequest, match="longer than 0.2 s"):
            cache.compile(slow)
        held.release.set()  # the compile now ends in the background
        _wait_for(lambda: cache.pool.idle())
        assert not cache.cached(slow) and cache.bytes_held == 0
        with pytest.raises(InvalidRequest, match="longer than"):
            cache.submit(slow)  # refused at once for a while ...
        monkeypatch.setattr(grammar_cache, "TOO_SLOW_FOR_S", 0.0)
        cache.pool.timeout_s = 30.0  # a loaded machine's compile of it must not be refused again
        assert cache.compile(slow) is not None  # ... not for good
    finally:
        held.release.set()
        cache.close()


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("grammar", "root ::= root"),
        Constraint("grammar", "root ::= []"),
        Constraint("grammar", r"root ::= [^\x00-\U0010FFFF]"),
        Constraint("json_schema", json.dumps({"$ref": "#"})),
        Constraint("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
    ],
    ids=["self-rule", "empty-class", "full-negated-class", "self-ref", "ref-cycle"],
)
def test_a_constraint_that_admits_nothing_is_refused_at_compile(tokenizer, constraint):
    cache = _cache(tokenizer)
    try:
        with pytest.raises(InvalidRequest, match="admits no output") as err:
            cache.compile(constraint)
        assert err.value.field == constraint.field
        assert not cache.cached(constraint)
    finally:
        cache.close()


UNENFORCED = [
    ({"type": "string", "not": {"const": "a"}}, "'not' at #"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf' at #"),
    (
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
        "'$ref' at #/properties/a",
    ),
    ({"$defs": {"x": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "'$ref' at #"),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, "'if' at #"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' at #"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "'contains' at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at #"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "'dependentSchemas' at #"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "'dependencies' at #"),
    ({"type": "object", "properties": {"a": {"$dynamicRef": "#n"}}}, "'$dynamicRef' at #/properties/a"),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, "'oneOf' at #"),
    (
        {"type": "object", "properties": {"v": {"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}}},
        "'oneOf' at #/properties/v",
    ),
    (
        {"type": "array", "items": {"anyOf": [{"type": "string", "not": {"const": "x"}}]}},
        "'not' at #/items/anyOf/0",
    ),
    ({"$defs": {"a/b": {"not": {}}}, "$ref": "#/$defs/a~1b"}, "'not' at #/$defs/a~1b"),
]


@pytest.mark.parametrize(("schema", "where"), UNENFORCED, ids=[w.split("'")[1] for _, w in UNENFORCED])
def test_schema_keywords_xgrammar_ignores_are_refused_by_name(tokenizer, schema, where):
    cache = _cache(tokenizer)
    try:
        with pytest.raises(InvalidRequest, match="cannot enforce") as err:
            cache.compile(Constraint("json_schema", json.dumps(schema)))
        assert where in err.value.message and err.value.field == "sampling_params.json_schema"
    finally:
        cache.close()


def test_what_xgrammar_enforces_still_compiles(tokenizer):
    """Local references, one-schema allOf, oneOf whose branches cannot overlap (types, or a
    required tag property with different const values, as pydantic's discriminated unions are),
    and data that merely contains the refused words."""
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}}}
    schemas = [
        {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
        {"allOf": [{"type": "integer", "minimum": 3}]},
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        {"oneOf": [{"enum": ["a", "b"]}, {"const": "c"}]},
        {
            "$defs": {"Cat": {**cat, "required": ["kind"]}, "Dog": {**dog, "required": ["kind"]}},
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        },
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["not", "$ref"]}}},
    ]
    cache = _cache(tokenizer)
    try:
        for schema in schemas:
            assert cache.compile(Constraint("json_schema", json.dumps(schema))) is not None, schema
    finally:
        cache.close()


IGNORED_BY_XGRAMMAR = [
    ({"type": "string", "not": {"const": "a"}}, '"a"'),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, '"x"'),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, "11"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "5"),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1}',
    ),
]


@pytest.mark.parametrize(("schema", "breaking"), IGNORED_BY_XGRAMMAR)
def test_the_refused_keywords_are_ones_xgrammar_lets_through(tokenizer, schema, breaking):
    """Why they are refused (and a canary for an xgrammar upgrade that enforces one: then lift its
    refusal): compiled as is, the grammar accepts an output the schema rejects."""
    import jsonschema
    import xgrammar as xgr

    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(breaking))
    compiled = tokenizer.xgr_compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=True
    )
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(breaking) and matcher.is_completed()
