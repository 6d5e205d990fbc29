"""A Generate request's prompts are checked one by one as they are tokenized (issue 31, item 15):
many texts just under the characters-per-token pre-check stop at the first too long in tokens,
instead of all being tokenized first. A real engine (tiny model, SmolLM2's tokenizer)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.generate_inputs import engine_work
from loraplex.services.inference.proto_convert import MAX_CHARS_PER_TOKEN
from loraplex.services.inference.server_args import ServerArgs
from loraplex.v1 import inference_pb2 as pb
from tests.support.lora_reference import async_engine

CONTEXT = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def setup(tiny_llama_path: Path):
    args = ServerArgs.from_fields(
        model_path=str(tiny_llama_path),
        device="cpu",
        max_total_tokens=256,
        page_size=4,
        context_length=CONTEXT,
    )
    engine = async_engine(args)
    yield engine, args
    asyncio.run(engine.shutdown())


class CountingTokenizer:
    """The engine's own tokenize, counted."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0
        self.tokenize = engine.tokenize

    def __call__(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        self.calls += 1
        return self.tokenize(text, add_special_tokens, adapter)


def test_first_too_long_prompt_stops_the_tokenizing(setup, monkeypatch):
    engine, args = setup
    # under the character pre-check (CONTEXT * MAX_CHARS_PER_TOKEN) but far over CONTEXT tokens
    long_text = "one two three " * (CONTEXT * MAX_CHARS_PER_TOKEN // 15)
    assert len(long_text) <= CONTEXT * MAX_CHARS_PER_TOKEN and len(engine.tokenize(long_text)) > CONTEXT
    counter = CountingTokenizer(engine)
    monkeypatch.setattr(engine, "tokenize", counter)
    for request, where in (
        (pb.GenerateRequest(text=["short", long_text, long_text, long_text]), "text[1]"),
        (pb.GenerateRequest(inputs=[pb.Input(text=long_text)] * 4), "inputs[0]"),
    ):
        counter.calls = 0
        with pytest.raises(InvalidRequest) as info:
            engine_work(engine, request, args)
        assert info.value.field == where and "tokens" in info.value.message
        assert counter.calls == int(where[-2]) + 1  # nothing tokenized after the first too long


def test_prompts_that_fit_are_all_tokenized(setup):
    engine, args = setup
    work = engine_work(engine, pb.GenerateRequest(text=["a b c", "d e f"]), args)
    assert [w.where for w in work] == ["text[0]", "text[1]"] and all(w.prompt_ids for w in work)
