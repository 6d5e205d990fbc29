"""The FastAPI app: each HTTP call is one gRPC call to `--target`; streams are server-sent events.

Work whose time grows with a request (reading its JSON body, building and encoding the answer,
parsing tool calls out of the output) runs in worker threads, never on the event loop, so one caller's
big request or long output cannot hold up the others (`/health` included).

The gRPC call carries `x-loraplex-adapter` (the adapter, "" for the base model) so a router in
front of several servers can send an adapter's calls where it is resident, and the caller's
`Authorization` header so a server started with --api-token checks it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path, PurePosixPath

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from loraplex.services.openai import (
    chat_schema,
    completion_schema,
    reply,
    responses,
    responses_route,
    schema,
    stream,
    structured,
    vllm_routes,
)
from loraplex.services.openai.disconnect import unless_client_leaves
from loraplex.services.openai.door_metrics import DoorMetrics
from loraplex.services.openai.errors import OpenAIError, bad_request, from_grpc, model_not_found
from loraplex.services.openai.inputs import (
    check_adapter_model,
    check_authorization,
    check_model_text,
    check_strings,
    parse_json,
)
from loraplex.services.openai.responses import public_source
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ADAPTER_HEADER = "x-loraplex-adapter"
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # the inference server's default --max-message-bytes


def channel_options(max_body_bytes: int) -> list[tuple[str, int]]:
    """As the Python client's: keepalive within the server's ping policy, a quick reconnect. A request
    built from a body is no bigger than the body (plus slack); a reply is bounded by the server
    (--max-message-bytes), so the door adds no limit of its own that would fail as 429."""
    return [
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", max_body_bytes + (1 << 20)),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Backend:
    """The gRPC side: one channel, opened on the serving loop; the base model's names, learnt once."""

    def __init__(
        self,
        target: str,
        served_model_name: str | None,
        timeout_s: float | None,
        tls_ca: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.target, self.timeout_s, self.tls_ca = target, timeout_s, tls_ca
        self.max_body_bytes = max_body_bytes
        self.served_model_name = served_model_name
        self._stub: pb_grpc.InferenceStub | None = None
        self._channel = None
        self._base_names: tuple[str, ...] | None = None
        self.max_new_tokens_limit = 0  # the server's --max-new-tokens-limit, learnt with the names
        self.context_length = 0  # the model's, learnt with the names

    @property
    def stub(self) -> pb_grpc.InferenceStub:
        if self._stub is None:
            options = channel_options(self.max_body_bytes)
            if self.tls_ca:
                credentials = grpc.ssl_channel_credentials(root_certificates=Path(self.tls_ca).read_bytes())
                self._channel = grpc.aio.secure_channel(self.target, credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=options)
            self._stub = pb_grpc.InferenceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def base_names(self, metadata) -> tuple[str, ...]:
        """The names that mean the base model: --served-model-name (default: the model path's last
        part) first, then the server's own model string."""
        if self._base_names is None:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=30)
            first = self.served_model_name or PurePosixPath(info.model.rstrip("/")).name or info.model
            self._base_names = (first, info.model)
            self.max_new_tokens_limit = info.max_new_tokens_limit
            self.context_length = info.context_length
        return self._base_names

    async def adapter_for(self, model: str, metadata) -> str:
        check_model_text(model)
        if model in await self.base_names(metadata):
            return ""
        check_adapter_model(model)
        return model


def _metadata(request: Request, adapter: str | None = None) -> tuple[tuple[str, str], ...]:
    check_authorization(request.headers.get("authorization"))
    md = []
    if adapter is not None:
        md.append((ADAPTER_HEADER, adapter))
    auth = request.headers.get("authorization")
    if auth and auth.lower().startswith("bearer ") and auth[7:].strip() not in ("", "EMPTY"):
        md.append(("authorization", auth))
    return tuple(md)


def _checked_json(raw: bytes):
    body = parse_json(raw)
    check_strings(body)
    return body


async def _body(request: Request):
    return await asyncio.to_thread(_checked_json, await request.body())


def _refused(exc: grpc.RpcError, parsed, door_call: schema.DoorCall, chat: bool) -> OpenAIError:
    """The server's refusal in the caller's words: the constraint's field as written (structured.py),
    and `max_completion_tokens` where the caller wrote that rather than `max_tokens`."""
    err = structured.rename_error(from_grpc(exc, parsed.model, chat), door_call.fields)
    if chat and parsed.max_completion_tokens is not None and parsed.max_tokens is None:
        err.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", err.message)
        if err.param == "max_tokens":
            err.param = "max_completion_tokens"
    return err


def create_app(backend: Backend, admin_token: str | None = None) -> FastAPI:
    """The door's routes; `admin_token` ($LORAPLEX_ADMIN_TOKEN) switches on vLLM's adapter routes."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(
        title="loraplex OpenAI-compatible API",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.backend = backend
    app.add_middleware(DoorMetrics)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes (404), wrong methods (405) and the like, in OpenAI's error shape."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"Invalid URL ({where}): this server has no such route", "unknown_url"
        elif exc.status_code == 405:
            message, code = f"Method not allowed ({where})", "method_not_allowed"
        else:
            message, code = f"{exc.detail} ({where})", None
        err = OpenAIError(exc.status_code, message, code=code)
        response = err.response()
        for name, value in (exc.headers or {}).items():  # e.g. 405's Allow
            response.headers[name] = value
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")) or None
        return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param).response()

    @app.exception_handler(Exception)
    async def _unforeseen(request: Request, exc: Exception) -> Response:
        # A bug: OpenAI's error shape rather than a bare 500 page. Starlette re-raises the exception
        # after this response is sent, so uvicorn logs its traceback.
        return OpenAIError(
            500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error"
        ).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = _door_metrics(app).exposition()
        return Response(body, media_type=content_type)

    vllm_routes.add_routes(app, backend, _metadata, _body, admin_token)
    responses_route.add_route(app, backend, _metadata, _body, _resolve)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await model_list(request)})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        for entry in await model_list(request):
            if entry["id"] == model_id:
                return JSONResponse(entry)
        raise model_not_found(model_id)

    async def model_list(request: Request) -> list[dict]:
        md = _metadata(request)
        try:
            base = (await backend.base_names(md))[0]
            adapters: list[pb.AdapterInfo] = []
            token = ""
            while True:  # ListAdapters pages (1000 a page)
                page = await backend.stub.ListAdapters(
                    pb.ListAdaptersRequest(page_token=token), metadata=md, timeout=30
                )
                adapters.extend(page.adapters)
                if not (token := page.next_page_token):
                    break
        except grpc.RpcError as exc:
            raise from_grpc(exc, "") from None
        data = [
            {
                "id": base,
                "object": "model",
                "created": 0,
                "owned_by": "loraplex",
                "root": base,
                "parent": None,
            }
        ]
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": 0,
                "owned_by": "loraplex",
                "root": public_source(a.source, a.name),
                "parent": base,
            }
            for a in adapters
        ]
        return data

    async def generate(
        request: Request,
        parsed,
        door_call: schema.DoorCall,
        adapter: str,
        chat: bool,
    ) -> Response:
        md = _metadata(request, adapter)
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
        return EventSourceResponse(
            _events(call, first, state, include_usage, parsed.model, finisher), ping=15
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = await asyncio.to_thread(
            schema.parse, completion_schema.CompletionRequest, await _body(request)
        )
        adapter = await _resolve(backend, request, parsed.model)
        door_call = await asyncio.to_thread(completion_schema.completion_call, parsed, adapter)
        return await generate(request, parsed, door_call, adapter, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed, legacy = await asyncio.to_thread(chat_schema.parse_chat, await _body(request))
        adapter = await _resolve(backend, request, parsed.model)
        door_call = await asyncio.to_thread(
            chat_schema.chat_call, parsed, adapter, backend.max_new_tokens_limit, legacy
        )
        return await generate(request, parsed, door_call, adapter, True)

    return app


def _door_metrics(app: FastAPI) -> DoorMetrics:
    """The metrics middleware instance of `app` (built by Starlette when the app starts)."""
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, DoorMetrics):
        layer = getattr(layer, "app", None)
    if layer is None:
        raise RuntimeError("the door's metrics middleware is not in the stack")
    return layer


async def _resolve(backend: Backend, request: Request, model: str) -> str:
    try:
        return await backend.adapter_for(model, _metadata(request))
    except grpc.RpcError as exc:
        raise from_grpc(exc, model) from None


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
