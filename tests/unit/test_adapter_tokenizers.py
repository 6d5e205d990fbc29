"""An adapter's own tokenizer (engine/adapter_tokenizers.py): built over the base's files from what
the adapter ships, kept only when it differs from the base's, refused naming the token when an id
is past the embedding rows or an added token does not land where its files say, and bounded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loraplex.services.inference.engine.adapter_tokenizers import AdapterTokenizers
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
