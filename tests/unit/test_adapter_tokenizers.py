"""An adapter's own tokenizer (engine/adapter_tokenizers.py): built over the base's files from what
the adapter ships, kept only when it differs from the base's, refused naming the token when an id
is past the embedding rows or an added token does not land where its files say, and bounded. Its
requests' constraints are compiled on its token strings (engine/grammar_cache.py), kept apart from
the base's, and dropped with it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.adapter_tokenizers import AdapterTokenizers
from loraplex.services.inference.engine.grammar import GrammarState, allocate_bitmask
from loraplex.services.inference.engine.grammar_cache import GrammarCache, constraint_digest
from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from tests.support.adapter_tokenizer import MARKER, MARKER_ID, write_marker_tokenizer

ROWS = 49152  # SmolLM2's embedding


@pytest.fixture(scope="module")
def base(smollm2_path) -> Path:
    return smollm2_path


@pytest.fixture(scope="module")
def base_tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


@pytest.fixture(scope="module")
def marker_files(base, tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("marker")
    write_marker_tokenizer(base, d)
    return {n: (d / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}


def test_the_base_tokenizer_files_cost_nothing(base, base_tokenizer):
    """An adapter saved with the base's tokenizer (or only a chat template) uses the base's."""
    tokenizers = AdapterTokenizers(base, ROWS, base_tokenizer)
    same = {n: (base / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    assert tokenizers.prepare(same) is None
    assert tokenizers.prepare({"tokenizer_config.json": b'{"chat_template": "x"}'}) is None
    assert tokenizers.prepare({}) is None


@pytest.fixture(scope="module")
def marker(base, base_tokenizer, marker_files):
    """(the cache, the marker adapter's tokenizer in it, assigned to adapter "m")."""
    tokenizers = AdapterTokenizers(base, ROWS, base_tokenizer, limit=1)
    own = tokenizers.prepare(marker_files)
    tokenizers.check_room("m", own)
    tokenizers.assign("m", own)
    return tokenizers, own


def test_an_added_token_is_one_id_for_its_adapter_only(marker, base_tokenizer, marker_files):
    tokenizers, own = marker
    assert own is not None and tokenizers.prepare(marker_files) is own  # one per distinct files
    text = f"a {MARKER} b"
    assert MARKER_ID in own.caller(text).input_ids
    assert MARKER_ID not in base_tokenizer(text).input_ids  # the base splits it
    assert tokenizers.get("m") is own and tokenizers.get("other") is None and tokenizers.get(None) is None


def test_an_id_past_the_embedding_rows_is_refused_naming_the_token(base, base_tokenizer, tmp_path):
    write_marker_tokenizer(base, tmp_path, past_rows=True)
    files = {"tokenizer.json": (tmp_path / "tokenizer.json").read_bytes()}
    with pytest.raises(
        AdapterIncompatible, match=f"'{MARKER}' at id {ROWS}, past this base model's {ROWS}"
    ) as e:
        AdapterTokenizers(base, ROWS, base_tokenizer).prepare(files)
    assert e.value.field == "tokenizer"


def test_an_added_token_off_its_stated_id_is_refused(base, base_tokenizer):
    """added_tokens.json says id 5 (a slow tokenizer's file: the fast tokenizer loaded does not read
    it, so the token is missing; were it read, a new text would take the next free id)."""
    files = {"added_tokens.json": json.dumps({"<tool_call>": 5}).encode()}
    with pytest.raises(AdapterInvalid, match="'<tool_call>' at id 5, but the tokenizer they load"):
        AdapterTokenizers(base, ROWS, base_tokenizer).prepare(files)


def test_files_that_are_not_a_tokenizer_are_refused(base, base_tokenizer):
    with pytest.raises(AdapterInvalid, match="tokenizer.json is not valid JSON") as e:
        AdapterTokenizers(base, ROWS, base_tokenizer).prepare({"tokenizer.json": b"{"})
    assert e.value.field == "tokenizer.json"


def test_distinct_tokenizers_are_bounded_and_dropped_with_their_last_adapter(marker):
    """At most `limit` distinct (here 1); adapters shipping the same files share one."""
    tokenizers, own = marker
    tokenizers.check_room("b", own)  # the same files: shared, no new entry
    other = dataclasses.replace(own, key="sha256:other")
    with pytest.raises(AdapterIncompatible, match="1 distinct adapter tokenizers are in use") as e:
        tokenizers.check_room("b", other)
    assert e.value.field == "tokenizer"
    tokenizers.check_room("m", other)  # replacing m's own
    tokenizers.assign("b", own)
    tokenizers.forget("m")
    assert tokenizers.distinct() == 1
    tokenizers.forget("b")
    assert tokenizers.get("b") is None and tokenizers.distinct() == 0


EOS = 2  # SmolLM2's <|im_end|>, the stop token here
AS_MARKER = (Constraint("regex", re.escape(MARKER)), Constraint("choice", choices=(MARKER,)))


@pytest.fixture(scope="module")
def base_compiler(base_tokenizer):
    """xgrammar's table of the base tokenizer, built once for the module's caches."""
    return GrammarCache(base_tokenizer, ROWS, [EOS]).prepare()


@pytest.fixture
def grammars(base, base_tokenizer, base_compiler, marker):
    """(a grammar cache on the base tokenizer, adapter tokenizers that drop theirs from it, the
    marker adapter "m"'s entry there: a fresh entry on the module's marker tokenizer)."""
    cache = GrammarCache(base_tokenizer, ROWS, [EOS], tokenizer_name=str(base), compiler=base_compiler)
    tokenizers = AdapterTokenizers(base, ROWS, base_tokenizer, on_drop=cache.forget_tokenizer)
    own = dataclasses.replace(marker[1], grammar_compiler=None, dropped=False)
    tokenizers.assign("m", own)
    yield cache, tokenizers, own
    cache.close()


def _allowed(state: GrammarState) -> torch.Tensor:
    """Which ids the grammar allows next (bool, one per logit)."""
    bitmask = allocate_bitmask(1, ROWS, pin=False)
    state.fill(bitmask, 0)
    return ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:ROWS].bool()


@pytest.mark.parametrize("constraint", AS_MARKER, ids=lambda c: c.kind)
def test_a_constraint_is_compiled_on_its_requests_tokenizer(grammars, base_tokenizer, constraint):
    """Output exactly the marker's text: under the adapter the marker's one id is allowed and ends it
    (then only EOS); under the base that id is "ectable" and forbidden, the text comes in pieces.
    (Compiled on the base's strings for both, the adapter could not emit its own marker token.)"""
    cache, _, own = grammars
    under_own, under_base = cache.compile(constraint, own=own), cache.compile(constraint)
    assert _allowed(GrammarState(under_own))[MARKER_ID] and not _allowed(GrammarState(under_base))[MARKER_ID]
    state = GrammarState(under_own)
    assert state.accept(0, MARKER_ID)
    assert _allowed(state).nonzero().flatten().tolist() == [EOS]
    assert not GrammarState(under_base).accept(0, MARKER_ID)
    pieces = base_tokenizer(MARKER, add_special_tokens=False).input_ids
    base_state = GrammarState(under_base)
    assert len(pieces) > 1 and all(base_state.accept(i, t) for i, t in enumerate(pieces))


def test_base_and_adapter_grammars_are_kept_apart_and_go_with_the_tokenizer(grammars, base):
    """One constraint, two tokenizers: two cache entries, two compilers; the base's key is as it was
    before adapters had tokenizers. The adapter's entry (and its compiler, on the tokenizer entry)
    goes with the last adapter using that tokenizer; a compile of it finishing later is not kept."""
    cache, tokenizers, own = grammars
    c = AS_MARKER[0]
    under_own, under_base = cache.compile(c, own=own), cache.compile(c)
    assert under_own is not under_base
    assert cache.key(c) == (str(base), constraint_digest(c)) and cache.key(c, own) == (
        own.key,
        constraint_digest(c),
    )
    assert cache.cached(c) and cache.cached(c, own)
    assert cache.compile(c, own=own) is under_own and cache.compile(c) is under_base  # hits
    assert own.grammar_compiler is not None and own.grammar_compiler is not cache.prepare()
    base_bytes = int(under_base.memory_size_bytes)
    tokenizers.forget("m")
    assert own.dropped and tokenizers.distinct() == 0
    assert not cache.cached(c, own) and cache.cached(c) and cache.bytes_held == base_bytes
    cache.compile(c, own=own)  # a request that looked the tokenizer up before it went
    assert not cache.cached(c, own) and cache.bytes_held == base_bytes
