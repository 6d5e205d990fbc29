"""The door's side of the gRPC call: the channel to `--target` (`Backend`, which learns the base
model's names once), and what each HTTP request brings to its call: the metadata, the JSON body and
the adapter its `model` names. Every route family (completion_routes.py, models_route.py,
responses_route.py, vllm_routes.py) reads its requests through these.

The gRPC call carries `x-loraplex-adapter` (the adapter, "" for the base model) so a router in
front of several servers can send an adapter's calls where it is resident, and the caller's
`Authorization` header so a server started with --api-token checks it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path, PurePosixPath

import grpc
from fastapi import Request

from loraplex.services.openai.errors import from_grpc
from loraplex.services.openai.inputs import (
    check_adapter_model,
    check_authorization,
    check_model_text,
    check_strings,
    parse_json,
)
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc

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


def call_metadata(request: Request, adapter: str | None = None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata of `request`'s call: the adapter header when `adapter` is given (None for a
    call that names none), and the caller's bearer token, checked first."""
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


async def read_body(request: Request):
    """The request's JSON body, parsed and checked (depth, lone surrogates) in a worker thread."""
    return await asyncio.to_thread(_checked_json, await request.body())


async def resolve_adapter(backend: Backend, request: Request, model: str) -> str:
    """The adapter `model` names ("" for the base model); the server's refusal in OpenAI's shape."""
    try:
        return await backend.adapter_for(model, call_metadata(request))
    except grpc.RpcError as exc:
        raise from_grpc(exc, model) from None
