"""Tokenize and Detokenize: a text or a chat input -> its prompt ids exactly as Generate would build
them (the adapter's chat template included), and ids -> text. The door's vLLM-shaped /tokenize and
/detokenize routes are these calls."""

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


async def tokenize(engine: Engine, resolver: AdapterResolver, request: pb.TokenizeRequest) -> list[int]:
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
        return []
    adapter = request.adapter or inp.adapter
    if adapter:
        check_adapter_name(adapter, field="adapter")
        await resolver.ensure({adapter})  # NOT_FOUND for an unknown name; its template is then loaded
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    if inp.HasField("add_special_tokens"):
        add_special = inp.add_special_tokens
    if inp.text:
        return await asyncio.to_thread(engine.tokenize, inp.text, add_special)
    if adapter:
        resolver.acquire(adapter)  # kept resident while its template renders
    try:
        return await asyncio.to_thread(prompt_of_input, engine, inp, adapter, 0)
    finally:
        if adapter:
            resolver.release(adapter)


def detokenize(tokenizer, request: pb.DetokenizeRequest) -> str:
    ids = list(request.token_ids)
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise InvalidRequest(
            f"token_ids has {len(ids)} entries; at most {MAX_DETOKENIZE_IDS}", field="token_ids"
        )
    vocab = len(tokenizer)
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise InvalidRequest(f"token_ids has {bad[0]}: ids must be in [0, {vocab})", field="token_ids")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else False
    return tokenizer.decode(ids, skip_special_tokens=skip)
