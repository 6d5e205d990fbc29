"""A GenerateRequest -> the engine requests it stands for, with the request's shape checked
(field combinations, counts, sizes before tokenizing, chat messages, stop strings, the queue).
Each prompt and its sampling params are checked against the model once, by `Engine.generate`
(see `open_streams`).

A request gives either `text` (with `adapter` per text, one for all, or none) or `inputs`:
each a text, prompt token ids or chat messages, with its own adapter and optionally its own
`SamplingParams`. Every input runs `n` times (its params' `n`); sample j > 0 of a seeded input
uses seed + j, so sample 0 is exactly what the same input with n = 1 gives.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import NamedTuple

from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.chat_tools import parse_tool_calls, parse_tools
from loraplex.services.inference.engine.types import RequestOutput, SamplingParams
from loraplex.services.inference.errors import (
    CapacityExceeded,
    ContextLengthExceeded,
    InvalidRequest,
    LoraplexError,
)
from loraplex.services.inference.proto_convert import (
    MAX_CHARS_PER_TOKEN,
    adapters_per_input,
    check_adapter_name,
    to_engine_params,
)
from loraplex.services.inference.server_args import ServerArgs
from loraplex.v1 import inference_pb2 as pb

MAX_CHAT_MESSAGES = 1024
# OpenAI's roles. A free-text role would let a caller write a turn the template renders as its
# own markup (a newline, a special token, "system" spelled some other way).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_MASK = (1 << 64) - 1


class EngineWork(NamedTuple):
    """One engine request: sample `sample` of input `index`.

    `where` names the input's field (`text[i]` / `inputs[i]`); `params_where` prefixes its
    sampling params' fields ("" for the request's shared params, `inputs[i].` for its own)."""

    index: int
    sample: int
    prompt_ids: list[int]
    adapter: str  # "" = base model
    params: SamplingParams
    where: str
    params_where: str
    draft_adapter: str = ""  # the draft model's adapter ("" = none)


def _prefixed(exc: InvalidRequest, prefix: str) -> InvalidRequest:
    return InvalidRequest(
        f"{prefix}{exc.message}", field=f"{prefix}{exc.field}" if exc.field else prefix.rstrip(".")
    )


def _params(p: pb.SamplingParams, args: ServerArgs, prefix: str = "") -> tuple[SamplingParams, int]:
    """Engine params and n for one input."""
    try:
        params = to_engine_params(p, args)
    except InvalidRequest as exc:
        raise _prefixed(exc, prefix) if prefix else exc from None
    return params, max(1, p.n)


def _bad_words_ids(engine: Engine, words, adapter: str) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word as tokenized alone and after a space (a word inside a
    sentence is usually its spaced form), without special tokens, by the adapter's tokenizer;
    duplicates once."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for form in (word, word if word.startswith(" ") else " " + word):
            ids = tuple(engine.tokenize(form, add_special_tokens=False, adapter=adapter or None))
            if ids:
                out[ids] = None
    return tuple(out)


def _with_prompt_options(
    engine: Engine, p: pb.SamplingParams, params: SamplingParams, adapter: str
) -> SamplingParams:
    """The options that need the tokenizer (bad_words)."""
    if not p.bad_words:
        return params
    return dataclasses.replace(params, bad_words_ids=_bad_words_ids(engine, p.bad_words, adapter))


def _samples(params: SamplingParams, n: int) -> list[SamplingParams]:
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + j) & SEED_MASK) for j in range(n)]


def prompt_of_input(engine: Engine, inp: pb.Input, adapter: str, i: int) -> list[int]:
    """Input `i`'s prompt ids (text, ids or rendered messages); Tokenize renders with it too."""
    where = f"inputs[{i}]"
    given = [
        name
        for name, present in (
            ("text", bool(inp.text)),
            ("token_ids", len(inp.token_ids) > 0),
            ("messages", len(inp.messages) > 0),
        )
        if present
    ]
    if len(given) != 1:
        raise InvalidRequest(
            f"{where} must give exactly one of text, token_ids or messages (got "
            f"{', '.join(given) or 'none'})",
            field=where,
        )
    if inp.HasField("add_generation_prompt") and not inp.messages:
        raise InvalidRequest(
            f"{where}.add_generation_prompt applies to messages only", field=f"{where}.add_generation_prompt"
        )
    for name in ("tools_json", "chat_template_kwargs_json", "continue_final_message"):
        if getattr(inp, name) and not inp.messages:
            raise InvalidRequest(f"{where}.{name} applies to messages only", field=f"{where}.{name}")
    if inp.HasField("add_special_tokens") and not inp.text:
        raise InvalidRequest(
            f"{where}.add_special_tokens applies to text only", field=f"{where}.add_special_tokens"
        )
    if inp.token_ids:
        return list(inp.token_ids)
    if inp.text:
        add_special = inp.add_special_tokens if inp.HasField("add_special_tokens") else True
        return engine.tokenize(inp.text, add_special, adapter=adapter or None)
    if len(inp.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(
            f"{where}.messages has {len(inp.messages)} entries; at most {MAX_CHAT_MESSAGES}",
            field=f"{where}.messages",
        )
    messages = []
    for j, m in enumerate(inp.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{where}.messages[{j}].role is {m.role[:40]!r}; it must be one of {', '.join(CHAT_ROLES)}",
                field=f"{where}.messages[{j}].role",
            )
        message = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            field = f"{where}.messages[{j}].tool_calls_json"
            message["tool_calls"] = parse_tool_calls(m.tool_calls_json, field)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    add = inp.add_generation_prompt if inp.HasField("add_generation_prompt") else True
    tools = parse_tools(inp.tools_json, f"{where}.tools_json") if inp.tools_json else None
    kwargs = _template_kwargs(inp.chat_template_kwargs_json, f"{where}.chat_template_kwargs_json")
    try:
        return engine.render_chat(messages, adapter or None, add, tools, kwargs, inp.continue_final_message)
    except InvalidRequest as exc:
        if exc.field in ("chat_template_kwargs", "continue_final_message"):
            raise InvalidRequest(f"{where}.{exc.message}", field=f"{where}.{exc.field}") from None
        raise


def _template_kwargs(text: str, field: str) -> dict | None:
    if not text:
        return None
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{field} is not valid JSON: {exc}", field=field) from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{field} must be a JSON object", field=field)
    return kwargs


def _check_length(text_chars: int, where: str, context_length: int) -> None:
    if context_length and text_chars > context_length * MAX_CHARS_PER_TOKEN:
        raise ContextLengthExceeded(
            f"{where} has {text_chars} characters, more than a {context_length}-token context can hold",
            field=where,
            prompt_tokens=0,  # not tokenized: too long to be worth it
            context_length=context_length,
        )


def _check_tokens(ids: list[int], where: str, context_length: int) -> None:
    """Right after each prompt is tokenized, so a request of many long prompts stops at the first
    that cannot fit instead of tokenizing them all (the engine checks each again, with the KV size)."""
    if context_length and len(ids) >= context_length:
        raise ContextLengthExceeded(
            f"{where}: the prompt has {len(ids)} tokens; this model's context is {context_length} tokens "
            "including at least one new token",
            field=where,
            prompt_tokens=len(ids),
            context_length=context_length,
        )


def engine_work(engine: Engine, request: pb.GenerateRequest, args: ServerArgs) -> list[EngineWork]:
    """Every engine request of `request`, in input order then sample order; raises LoraplexError."""
    if request.ByteSize() > args.max_message_bytes:
        raise InvalidRequest(
            f"request is {request.ByteSize()} bytes; this server accepts at most {args.max_message_bytes}"
            " (--max-message-bytes)",
            field="text",
        )
    if request.text and request.inputs:
        raise InvalidRequest("give text or inputs, not both", field="inputs")
    field = "inputs" if request.inputs else "text"
    n_inputs = len(request.inputs) or len(request.text)
    if n_inputs == 0:
        raise InvalidRequest("text (or inputs) must have at least one entry", field="text")
    shared = (*_params(request.sampling_params, args), "")
    per_input: list[tuple[SamplingParams, int, str]] = [
        (*_params(inp.sampling_params, args, f"inputs[{i}]."), f"inputs[{i}].")
        if inp.HasField("sampling_params")
        else shared
        for i, inp in enumerate(request.inputs)
    ] or [shared] * n_inputs
    protos = [
        inp.sampling_params if inp.HasField("sampling_params") else request.sampling_params
        for inp in request.inputs
    ] or [request.sampling_params] * n_inputs
    total = sum(n for _, n, _ in per_input)
    if total > args.max_inputs_per_request:
        raise InvalidRequest(
            f"{n_inputs} inputs and {total} completions in one request; this server accepts at most "
            f"{args.max_inputs_per_request} (--max-inputs-per-request)",
            field=field,
        )
    if request.inputs:
        if len(request.adapter) > 1:
            raise InvalidRequest(
                "with inputs, adapter may have at most one entry (the default for inputs that name none)",
                field="adapter",
            )
        default = request.adapter[0] if request.adapter else ""
        adapters = [inp.adapter or default for inp in request.inputs]
        for i, name in enumerate(adapters):
            if name:
                check_adapter_name(name, field=f"inputs[{i}].adapter")
    else:
        adapters = adapters_per_input(request)
    waiting = engine.stats().waiting
    if waiting + total > args.engine.max_queued_requests:
        raise CapacityExceeded(
            f"{waiting} requests are queued and this call adds {total}; the queue holds "
            f"{args.engine.max_queued_requests} (--max-queued-requests): retry later"
        )
    context_length = engine.model_info().context_length
    work: list[EngineWork] = []
    for i in range(n_inputs):
        if request.inputs:
            inp = request.inputs[i]
            where = f"inputs[{i}]"
            _check_length(len(inp.text) + sum(len(m.content) for m in inp.messages), where, context_length)
            ids = prompt_of_input(engine, inp, adapters[i], i)
        else:
            where = f"text[{i}]"
            if not request.text[i]:
                raise InvalidRequest(f"text[{i}] is empty", field=where)
            _check_length(len(request.text[i]), where, context_length)
            ids = engine.tokenize(request.text[i], adapter=adapters[i] or None)
        if protos[i].truncate_prompt_tokens:  # vLLM's: keep the prompt's last k tokens
            ids = ids[-protos[i].truncate_prompt_tokens :]
        _check_tokens(ids, where, context_length)
        params, n, params_where = per_input[i]
        params = _with_prompt_options(engine, protos[i], params, adapters[i])
        draft = (request.inputs[i].draft_adapter if request.inputs else "") or request.draft_adapter
        work.extend(
            EngineWork(i, j, ids, adapters[i], p, where, params_where, draft)
            for j, p in enumerate(_samples(params, n))
        )
    return work


def open_streams(engine: Engine, rpc_id: str, work: list[EngineWork]) -> list[AsyncIterator[RequestOutput]]:
    """Every work item's engine stream, all checked (prompt and sampling params, by the engine)
    before any is queued: one the model cannot take fails the whole call, the error naming the
    request field (`text[i]` / `inputs[i]`, `[inputs[i].]sampling_params.NAME`)."""
    streams = []
    for k, w in enumerate(work):
        try:
            streams.append(
                engine.generate(
                    f"{rpc_id}-{k}", w.prompt_ids, w.adapter or None, w.params, w.draft_adapter or None
                )
            )
        except LoraplexError as exc:
            if exc.field == "text":
                exc.field, exc.message = w.where, f"{w.where}: {exc.message}"
            elif exc.field and exc.field.startswith("sampling_params.") and w.params_where:
                exc.field, exc.message = f"{w.params_where}{exc.field}", f"{w.params_where}{exc.message}"
            raise
    return streams
