"""Admin authentication: with --admin-token, the RPCs that change the store need
`authorization: Bearer <token>` metadata. Reads (Get/List/Pull/Watch, health) stay open.

No metadata -> UNAUTHENTICATED; a wrong token -> PERMISSION_DENIED. Tokens are compared in
constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

ADMIN_METHODS = frozenset(
    {
        "/loraplex.v1.AdapterStore/RegisterAdapter",
        "/loraplex.v1.AdapterStore/DeleteAdapter",
    }
)


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, methods: frozenset[str] = ADMIN_METHODS):
        self._token = token.encode()
        self._methods = methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method not in self._methods:
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, given = header.partition(" ")
        if not header or scheme.lower() != "bearer":
            return _deny(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{details.method} needs 'authorization: Bearer <admin token>' metadata",
            )
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return _deny(grpc.StatusCode.PERMISSION_DENIED, f"the admin token for {details.method} is wrong")
        return await continuation(details)


def _deny(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    # Both admin methods are unary-unary; the request is not even parsed.
    return grpc.unary_unary_rpc_method_handler(abort, request_deserializer=lambda b: b)
