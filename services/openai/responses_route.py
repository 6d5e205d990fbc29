"""`POST /v1/responses`: the Responses body read as a chat call (responses_api.py), one gRPC call,
answered as a Response object or as Responses events (responses_api_stream.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, Response

from loraplex.services.openai import (
    chat_schema,
    responses,
    responses_api,
    responses_api_output,
    stream,
    structured,
)
from loraplex.services.openai.backend import Backend, call_metadata, read_body, resolve_adapter
from loraplex.services.openai.disconnect import unless_client_leaves
from loraplex.services.openai.errors import OpenAIError, from_grpc
from loraplex.services.openai.responses_api_stream import ResponseEvents


def add_route(app: FastAPI, backend: Backend) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await read_body(request)
        try:
            parsed, _ = chat_schema.parse_chat(responses_api.chat_body(body))
            adapter = await resolve_adapter(backend, request, parsed.model)
            door_call = chat_schema.chat_call(parsed, adapter, backend.max_new_tokens_limit)
        except OpenAIError as err:
            raise responses_api.rename(err) from None
        md = call_metadata(request, adapter)
        grpc_request = door_call.request

        def failed(exc: grpc.RpcError) -> OpenAIError:
            return responses_api.rename(
                structured.rename_error(from_grpc(exc, parsed.model, True), door_call.fields)
            )

        if not parsed.stream:
            call = backend.stub.Generate(grpc_request, metadata=md, timeout=backend.timeout_s)
            try:
                resp = await unless_client_leaves(request, call)
            except grpc.RpcError as exc:
                raise failed(exc) from None
            chat = responses.chat_body(resp, parsed.model, door_call.asked, door_call.tool_plan)
            return JSONResponse(responses_api_output.response_object(body, parsed.model, chat))
        call = backend.stub.GenerateStream(grpc_request, metadata=md, timeout=backend.timeout_s)
        try:
            first = await unless_client_leaves(request, call, call.read())
        except grpc.RpcError as exc:
            raise failed(exc) from None
        state = stream.StreamState(parsed.model, 1, True, door_call.asked, door_call.tool_plan)
        obfuscation = bool(parsed.stream_options and parsed.stream_options.include_obfuscation)
        events = ResponseEvents(body, parsed.model, obfuscation)
        return EventSourceResponse(_events(call, first, state, events, failed), ping=15)


async def _events(
    call, first, state: stream.StreamState, events: ResponseEvents, failed
) -> AsyncIterator[dict]:
    def sse(items: list[dict]) -> list[dict]:
        return [{"event": e["type"], "data": json.dumps(e)} for e in items]

    for item in sse(events.start()):
        yield item
    msg = first
    try:
        while msg is not grpc.aio.EOF:
            for chunk in state.chunks(msg):
                for item in sse(events.chunk(chunk)):
                    yield item
            msg = await call.read()
        for item in sse(events.chunk(state.usage_chunk())):
            yield item
    except grpc.RpcError as exc:  # after the 200: an `error` event, as OpenAI's streams send it
        for item in sse([events.error(failed(exc))]):
            yield item
    finally:
        call.cancel()
