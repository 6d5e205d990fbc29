"""Tokenize and Detokenize: a text or a chat input -> its prompt ids exactly as Generate would build
them (the adapter's chat template and tokenizer included), and ids -> text (by the adapter's
tokenizer). The door's vLLM-shaped /tokenize and /detokenize routes are these calls."""

from __future__ import annotations

import asyncio

from loraplex.services.inference.adapter_resolver import AdapterResolver
from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.generate_inputs import prompt_of_input
from loraplex.services.inference.proto_convert import MAX_CHARS_PER_TOKEN, check_adapter_name
from loraplex.v1 import inference_pb2 as pb

# Detokenize takes at most this many ids (a context's worth is far below).
MAX_DETOKENIZE_IDS = 1 << 20


async def tokenize(
    engine: Engine, resolver: AdapterResolver, request: pb.TokenizeRequest
) -> tuple[list[int], list[str]]:
    """The prompt ids and each id's token string, by the adapter's tokenizer."""
    context = engine.model_info().context_length
    limit = context * MAX_CHARS_PER_TOKEN
    has_input = request.HasField("input")
    if has_input and request.text:
        raise InvalidRequest("give text or input, not both", field="input")
    inp = request.input if has_input else pb.Input(text=request.text)
    chars = len(inp.text) + sum(len(m.content) for m in inp.messages)
    if limit and chars > limit:
        raise InvalidRequest(
            f"the input has {chars} characters; Tokenize accepts at most {limit}", field="text"
        )
    if request.HasField("add_special_tokens") and not inp.text:
        raise InvalidRequest("add_special_tokens applies to text only", field="add_special_tokens")
    if not has_input and not request.text:
        return [], []
    adapter = request.adapter or inp.adapter
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    if inp.HasField("add_special_tokens"):
        add_special = inp.add_special_tokens

    def work() -> tuple[list[int], list[str]]:
        if inp.text:
            ids = engine.tokenize(inp.text, add_special, adapter=adapter or None)
        else:
            ids = prompt_of_input(engine, inp, adapter, 0)
        with engine.tokenizer_for(adapter or None) as tokenizer:
            return ids, tokenizer.convert_ids_to_tokens(ids)

    return await _with_adapter(resolver, adapter, work)


async def _with_adapter(resolver: AdapterResolver, adapter: str, work):
    """`work()` on a thread, with `adapter` (when named) loaded (NOT_FOUND for an unknown name) and
    kept resident meanwhile: its template and tokenizer are those of the version loaded."""
    if not adapter:
        return await asyncio.to_thread(work)
    check_adapter_name(adapter, field="adapter")
    await resolver.ensure({adapter})
    resolver.acquire(adapter)
    try:
        return await asyncio.to_thread(work)
    finally:
        resolver.release(adapter)


async def detokenize(engine: Engine, resolver: AdapterResolver, request: pb.DetokenizeRequest) -> str:
    """The ids' text, by the adapter's tokenizer."""
    ids = list(request.token_ids)
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise InvalidRequest(
            f"token_ids has {len(ids)} entries; at most {MAX_DETOKENIZE_IDS}", field="token_ids"
        )
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else False

    def work() -> str:
        with engine.tokenizer_for(request.adapter or None) as tokenizer:
            vocab = len(tokenizer)
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequest(
                    f"token_ids has {bad[0]}: ids must be in [0, {vocab})", field="token_ids"
                )
            return tokenizer.decode(ids, skip_special_tokens=skip)

    return await _with_adapter(resolver, request.adapter, work)
