"""Wire-level gRPC helpers shared by both services' servers (beside the protos they serve).

The services share only the contract: this module knows messages and status codes, nothing of
either service.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError


class _Undecodable(NamedTuple):
    error: str


def _lenient(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    return parse


def _malformed(method: str, request: _Undecodable) -> str:
    return f"the request bytes are not a valid {method.rsplit('/', 1)[-1]} request message: {request.error}"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the request message get INVALID_ARGUMENT, not grpc's bare UNKNOWN.

    Only unary-request methods under `prefix` are wrapped: their deserializer returns a marker
    instead of raising, and the handler aborts on it instead of calling the servicer."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if (
            handler is None
            or not details.method.startswith(self.prefix)
            or handler.request_streaming
            or handler.request_deserializer is None
        ):
            return handler
        method, parse = details.method, _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed(method, request))
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, parse, handler.response_serializer)
        behavior = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed(method, request))
            result = behavior(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write() and returns
                await result

        return grpc.unary_stream_rpc_method_handler(stream, parse, handler.response_serializer)
