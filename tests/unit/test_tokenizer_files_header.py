"""The inference side's check of the tokenizer files a PullAdapter header carries (issue 59 L4):
only the carried names (never a path), each once and bounded, hashing to the record's
files_digest, which both sides compute the same way."""

from __future__ import annotations

import pytest

from loraplex.adapter_store.tokenizer_files import CARRIED_FILES as STORE_FILES
from loraplex.adapter_store.tokenizer_files import MAX_FILE_BYTES, MAX_TOKENIZER_JSON_BYTES, files_digest
from loraplex.services.inference.adapter_cache import (
    CARRIED_FILES,
    MAX_CARRIED_FILE_BYTES,
    MAX_CARRIED_TOKENIZER_JSON_BYTES,
    tokenizer_files_digest,
)
from loraplex.services.inference.errors import AdapterInvalid
from loraplex.services.inference.store_pull import _header_files
from loraplex.v1 import adapter_store_pb2 as pb

FILES = {"chat_template.jinja": b"{{ messages }}", "tokenizer_config.json": b"{}"}


def _header(files: list[tuple[str, bytes]], digest: str) -> tuple[pb.AdapterHeader, pb.AdapterRecord]:
    record = pb.AdapterRecord(name="a", files_digest=digest)
    header = pb.AdapterHeader(record=record, files=[pb.AdapterFile(name=n, content=c) for n, c in files])
    return header, record


def test_both_sides_agree_on_the_files_and_their_digest():
    assert CARRIED_FILES == STORE_FILES and MAX_CARRIED_FILE_BYTES == MAX_FILE_BYTES
    assert MAX_CARRIED_TOKENIZER_JSON_BYTES == MAX_TOKENIZER_JSON_BYTES
    assert tokenizer_files_digest(FILES) == files_digest(FILES) != files_digest({})
    assert files_digest({}) == tokenizer_files_digest({}) == ""
    header, record = _header(list(FILES.items()), files_digest(FILES))
    assert _header_files("a", header, record) == FILES


@pytest.mark.parametrize(
    "files",
    [
        [("../adapter_model.safetensors", b"x")],
        [("chat_template.jinja", b"a"), ("chat_template.jinja", b"b")],
        [("chat_template.jinja", b"x" * (MAX_CARRIED_FILE_BYTES + 1))],
        [("tokenizer.json", b"x" * (MAX_CARRIED_TOKENIZER_JSON_BYTES + 1))],
    ],
)
def test_an_unexpected_file_is_refused(files):
    header, record = _header(files, files_digest(dict(files)))
    with pytest.raises(AdapterInvalid, match="not one of chat_template.jinja"):
        _header_files("a", header, record)


def test_files_that_do_not_hash_to_the_record_are_refused():
    header, record = _header(list(FILES.items()), files_digest({"chat_template.jinja": b"other"}))
    with pytest.raises(AdapterInvalid, match="digest mismatch"):
        _header_files("a", header, record)
    header, record = _header([], files_digest(FILES))  # files the record names, missing
    with pytest.raises(AdapterInvalid, match="digest mismatch"):
        _header_files("a", header, record)
