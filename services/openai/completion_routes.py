"""`POST /v1/completions` and `POST /v1/chat/completions`: the body read (completion_schema.py,
chat_schema.py), one gRPC call (Generate, or GenerateStream for `stream`), the answer built
(responses.py) or streamed as server-sent events (stream.py), finished by reply.py.

Building and encoding an answer, and parsing tool calls out of a finished choice's output, grow
with the output: they run in worker threads, off the event loop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, Response

from loraplex.services.openai import (
    chat_schema,
    completion_schema,
    reply,
    responses,
    schema,
    stream,
    structured,
)
from loraplex.services.openai.backend import Backend, call_metadata, read_body, resolve_adapter
from loraplex.services.openai.disconnect import unless_client_leaves
from loraplex.services.openai.errors import OpenAIError, from_grpc


def add_routes(app: FastAPI, backend: Backend) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await asyncio.to_thread(
            schema.parse, completion_schema.CompletionRequest, await read_body(request)
        )
        adapter = await resolve_adapter(backend, request, parsed.model)
        door_call = await asyncio.to_thread(completion_schema.completion_call, parsed, adapter)
        return await _generate(backend, request, parsed, door_call, adapter, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed, legacy = await asyncio.to_thread(chat_schema.parse_chat, await read_body(request))
        adapter = await resolve_adapter(backend, request, parsed.model)
        door_call = await asyncio.to_thread(
            chat_schema.chat_call, parsed, adapter, backend.max_new_tokens_limit, legacy
        )
        return await _generate(backend, request, parsed, door_call, adapter, True)


async def _generate(
    backend: Backend,
    request: Request,
    parsed,
    door_call: schema.DoorCall,
    adapter: str,
    chat: bool,
) -> Response:
    """One Generate call answered as JSON, or one GenerateStream call answered as server-sent events."""
    md = call_metadata(request, adapter)
    grpc_request, tool_plan, asked = door_call.request, door_call.tool_plan, door_call.asked
    if tool_plan is not None and tool_plan.mode == "named" and (parsed.stop or parsed.stop_token_ids):
        tool_plan = tool_plan._replace(held=True)  # tools.py: a stop could cut the arguments
    if not parsed.stream:
        call = backend.stub.Generate(grpc_request, metadata=md, timeout=backend.timeout_s)
        try:
            resp = await unless_client_leaves(request, call)
        except grpc.RpcError as exc:
            raise _refused(exc, parsed, door_call, chat) from None
        if chat:

            def build() -> JSONResponse:  # the body is built and encoded here, off the event loop
                body = responses.chat_body(resp, parsed.model, asked, tool_plan)
                return JSONResponse(reply.finish_body(body, door_call.reply))

            return await asyncio.to_thread(build)

        def build_completion() -> JSONResponse:
            body = responses.completion_body(resp, parsed.model, asked)
            return JSONResponse(reply.finish_body(body, door_call.reply))

        return await asyncio.to_thread(build_completion)
    call = backend.stub.GenerateStream(grpc_request, metadata=md, timeout=backend.timeout_s)
    try:  # the first message (or the error) before the 200: a refused call gets its status
        first = await unless_client_leaves(request, call, call.read())
    except grpc.RpcError as exc:
        raise _refused(exc, parsed, door_call, chat) from None
    state = stream.StreamState(parsed.model, parsed.n, chat, asked, tool_plan)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    finisher = reply.StreamReply(door_call.reply, asked.score_only)
    return EventSourceResponse(_events(call, first, state, include_usage, parsed.model, finisher), ping=15)


def _refused(exc: grpc.RpcError, parsed, door_call: schema.DoorCall, chat: bool) -> OpenAIError:
    """The server's refusal in the caller's words: the constraint's field as written (structured.py),
    and `max_completion_tokens` where the caller wrote that rather than `max_tokens`."""
    err = structured.rename_error(from_grpc(exc, parsed.model, chat), door_call.fields)
    if chat and parsed.max_completion_tokens is not None and parsed.max_tokens is None:
        err.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", err.message)
        if err.param == "max_tokens":
            err.param = "max_completion_tokens"
    return err


def _encoded(state: stream.StreamState, msg, finisher: reply.StreamReply) -> list[str]:
    return [json.dumps(finisher.finish(chunk)) for chunk in state.chunks(msg)]


async def _events(
    call, first, state: stream.StreamState, include_usage: bool, model: str, finisher: reply.StreamReply
) -> AsyncIterator[str]:
    msg = first
    try:
        while msg is not grpc.aio.EOF:
            finisher.observe(msg)
            # a choice's end may parse its whole held output (tool calls): in a thread
            events = (
                await asyncio.to_thread(_encoded, state, msg, finisher)
                if msg.finish_reason
                else _encoded(state, msg, finisher)
            )
            for event in events:
                yield event
            msg = await call.read()
        if include_usage:
            yield json.dumps(finisher.finish(state.usage_chunk()))
    except grpc.RpcError as exc:  # after the 200: the error travels as an event, as OpenAI's streams do
        err = from_grpc(exc, model, state.chat)
        yield json.dumps(
            {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
        )
    finally:
        call.cancel()  # a client that went away cancels the gRPC call (and frees the server's KV)
    yield "[DONE]"
