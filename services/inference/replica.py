"""Which replica answered: trailing metadata `x-loraplex-replica` on every response.

Behind a router (deploy/nginx) several replicas share one address; this trailer lets clients,
tests and benchmarks see where each call landed. It is added by a server interceptor, so
every method carries it, errors included: the servicer's context is wrapped so that
`abort(..., trailing_metadata=...)` and `set_trailing_metadata` keep the replica pair.
"""

from __future__ import annotations

import inspect
import socket

import grpc

REPLICA_KEY = "x-loraplex-replica"
ADAPTER_KEY = "x-loraplex-adapter"  # set by clients, hashed by the router


def replica_id(configured: str) -> str:
    return configured or socket.gethostname()


class _ReplicaContext:
    """The servicer context, with the replica pair kept in whatever trailer is sent."""

    def __init__(self, context: grpc.aio.ServicerContext, pair: tuple[str, str]) -> None:
        self._context = context
        self._pair = pair
        context.set_trailing_metadata((pair,))

    def _with_pair(self, metadata) -> tuple:
        return (*[(k, v) for k, v in (metadata or ()) if k != REPLICA_KEY], self._pair)

    def set_trailing_metadata(self, metadata) -> None:
        self._context.set_trailing_metadata(self._with_pair(metadata))

    async def abort(self, code, details="", trailing_metadata=()):
        await self._context.abort(code, details, trailing_metadata=self._with_pair(trailing_metadata))

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class ReplicaInterceptor(grpc.aio.ServerInterceptor):
    """Outermost interceptor: wraps whatever handler the others return (auth denials too)."""

    def __init__(self, replica: str) -> None:
        self.pair = (REPLICA_KEY, replica)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        pair = self.pair
        if handler.unary_unary is not None or handler.stream_unary is not None:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request, context):
                result = behavior(request, _ReplicaContext(context, pair))
                return await result if inspect.isawaitable(result) else result

            factory = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary is not None
                else grpc.stream_unary_rpc_method_handler
            )
            return factory(unary, handler.request_deserializer, handler.response_serializer)
        behavior = handler.unary_stream or handler.stream_stream

        async def stream(request, context):
            result = behavior(request, _ReplicaContext(context, pair))
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write() and returns
                await result

        factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream is not None
            else grpc.stream_stream_rpc_method_handler
        )
        return factory(stream, handler.request_deserializer, handler.response_serializer)
