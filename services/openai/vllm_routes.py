"""vLLM's operational routes, in vLLM's shapes, over the gRPC API:

- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` -> LoadAdapter(name, source) (a Hub id,
  a local path on the server's machine or a file:// URI, as the gRPC call takes it), and
  `POST /v1/unload_lora_adapter` `{"lora_name"}` -> UnloadAdapter. Both need the admin token: the
  door answers them only when started with $LORAPLEX_ADMIN_TOKEN and the caller's bearer token is
  it (vLLM keeps them off unless VLLM_ALLOW_RUNTIME_LORA_UPDATING; here the token is the switch);
  the token travels on, so the server's --admin-token checks it again.
- `POST /tokenize` (a `prompt`, or chat `messages` rendered by the `model`'s chat template: an
  adapter's own when it ships one) -> `{"count", "max_model_len", "tokens", "token_strs"}`;
  `POST /detokenize` `{"model", "tokens"}` -> `{"prompt"}`. Both read text by the `model`'s
  tokenizer: an adapter's own when it ships one (added tokens).
- `GET /version` -> `{"version"}`.
"""

from __future__ import annotations

import hmac
import json
from importlib import metadata
from typing import Any

import grpc
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, PlainTextResponse, Response

from loraplex.services.openai import chat_schema, schema, tools
from loraplex.services.openai.backend import Backend, call_metadata, read_body, resolve_adapter
from loraplex.services.openai.errors import OpenAIError, from_grpc
from loraplex.v1 import inference_pb2 as pb

FORBID = ConfigDict(extra="forbid", strict=True)


class LoadLoRA(BaseModel):
    model_config = FORBID

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRA(BaseModel):
    model_config = FORBID

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; names are what identify an adapter here


class TokenizeCompletion(BaseModel):
    model_config = FORBID

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = FORBID

    model: str | None = None
    messages: list[chat_schema.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's default for chat: the template writes them
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class Detokenize(BaseModel):
    model_config = FORBID

    model: str | None = None
    tokens: list[int]


def version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        return "0+unknown"


def check_admin(request: Request, admin_token: str | None) -> None:
    if not admin_token:
        raise OpenAIError(
            403,
            "adapter loading over HTTP is off: start the door with LORAPLEX_ADMIN_TOKEN set (and the "
            "server with --admin-token) and send it as the bearer token",
            type_="permission_error",
            code="admin_routes_disabled",
        )
    auth = request.headers.get("authorization") or ""
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), admin_token.encode()):
        raise OpenAIError(
            401, "this route needs the admin token as the bearer token", type_="authentication_error"
        )


def add_routes(app: FastAPI, backend: Backend, admin_token: str | None) -> None:
    async def call(method, message, md, model: str = "", names: dict[str, str] | None = None):
        """The gRPC call; its error with `param` in the HTTP body's words (`names`: gRPC -> HTTP)."""
        try:
            return await method(message, metadata=md, timeout=backend.timeout_s or 300)
        except grpc.RpcError as exc:
            err = from_grpc(exc, model)
            for grpc_name, http_name in (names or {}).items():
                if err.param and err.param.startswith(grpc_name):
                    err.message = err.message.replace(grpc_name, http_name)
                    err.param = http_name + err.param[len(grpc_name) :]
            raise err from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        check_admin(request, admin_token)
        req = schema.parse(LoadLoRA, await read_body(request))
        md = call_metadata(request, req.lora_name)
        load = pb.LoadAdapterRequest(name=req.lora_name, source=req.lora_path)
        await call(backend.stub.LoadAdapter, load, md)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        check_admin(request, admin_token)
        req = schema.parse(UnloadLoRA, await read_body(request))
        md = call_metadata(request, req.lora_name)
        await call(backend.stub.UnloadAdapter, pb.UnloadAdapterRequest(name=req.lora_name), md, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def adapter_of(request: Request, model: str | None) -> str:
        if not model:
            return ""
        return await resolve_adapter(backend, request, model)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_body(request)
        chat = isinstance(body, dict) and "messages" in body
        req = schema.parse(TokenizeChat if chat else TokenizeCompletion, body)
        adapter = await adapter_of(request, req.model)
        if chat:
            inp = pb.Input(messages=tools.chat_messages(req.messages))
            if not req.add_generation_prompt:
                inp.add_generation_prompt = False
            inp.continue_final_message = req.continue_final_message
            if req.chat_template_kwargs:
                inp.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)
            plan = tools.plan(req.tools, None)
            if plan is not None:
                inp.tools_json = tools.tools_json(plan.tools)
            grpc_req = pb.TokenizeRequest(input=inp, adapter=adapter)
        else:
            grpc_req = pb.TokenizeRequest(text=req.prompt, adapter=adapter)
            grpc_req.add_special_tokens = req.add_special_tokens
        md = call_metadata(request, adapter)
        resp = await call(backend.stub.Tokenize, grpc_req, md, req.model or "")
        await backend.base_names(md)
        return JSONResponse(
            {
                "count": len(resp.token_ids),
                "max_model_len": backend.context_length,
                "tokens": list(resp.token_ids),
                "token_strs": list(resp.tokens) if req.return_token_strs else None,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = schema.parse(Detokenize, await read_body(request))
        if any(t < 0 or t > schema.UINT32_MAX for t in req.tokens):
            raise OpenAIError(400, "tokens must be token ids (non-negative)", param="tokens")
        adapter = await adapter_of(request, req.model)
        md = call_metadata(request, adapter)
        grpc_req = pb.DetokenizeRequest(token_ids=req.tokens, adapter=adapter)
        resp = await call(backend.stub.Detokenize, grpc_req, md, req.model or "", {"token_ids": "tokens"})
        return JSONResponse({"prompt": resp.text})

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": version()})
