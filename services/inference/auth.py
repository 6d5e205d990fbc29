"""Bearer tokens and TLS for the inference server.

`--api-token`: every `loraplex.v1.Inference` call needs `authorization: Bearer <token>`
(the admin token is accepted too). `--admin-token`: LoadAdapter / UnloadAdapter need the
admin token (without it they need the API token, if one is set). Health and reflection stay
open so load balancers and grpcurl `list` work. The same admin token is sent to the adapter
store, whose RegisterAdapter (called by LoadAdapter) needs it (see adapter_store/auth.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from loraplex.services.inference.server_args import ServerArgs

SERVICE_PREFIX = "/loraplex.v1.Inference/"
ADMIN_METHODS = frozenset({SERVICE_PREFIX + "LoadAdapter", SERVICE_PREFIX + "UnloadAdapter"})
STREAMING_METHODS = frozenset({SERVICE_PREFIX + "GenerateStream"})


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_token: str | None, admin_token: str | None) -> None:
        self._api = api_token.encode() if api_token else None
        self._admin = admin_token.encode() if admin_token else None

    def _accepted(self, method: str) -> list[bytes]:
        if method in ADMIN_METHODS and self._admin:
            return [self._admin]
        return [t for t in (self._api, self._admin) if t] if self._api else []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith(SERVICE_PREFIX):
            return await continuation(details)
        accepted = self._accepted(details.method)
        if not accepted:
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization", "")
        scheme, _, given = header.partition(" ")
        kind = "admin token" if details.method in ADMIN_METHODS and self._admin else "API token"
        if not header or scheme.lower() != "bearer":
            return _deny(
                details.method,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{details.method} needs 'authorization: Bearer <{kind}>' metadata",
            )
        if not any(hmac.compare_digest(given.strip().encode(), token) for token in accepted):
            return _deny(
                details.method, grpc.StatusCode.PERMISSION_DENIED, f"wrong {kind} for {details.method}"
            )
        return await continuation(details)


def _deny(method: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    # The request is not even parsed.
    if method in STREAMING_METHODS:
        return grpc.unary_stream_rpc_method_handler(abort, request_deserializer=lambda b: b)
    return grpc.unary_unary_rpc_method_handler(abort, request_deserializer=lambda b: b)


def interceptors(args: ServerArgs) -> list[grpc.aio.ServerInterceptor]:
    return [TokenInterceptor(args.api_token, args.admin_token)] if args.api_token or args.admin_token else []


def server_credentials(args: ServerArgs) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key; with --tls-ca, clients must present a certificate it signed."""
    if not args.tls_cert and not args.tls_key:
        if args.tls_ca:
            raise SystemExit("--tls-ca needs --tls-cert and --tls-key")
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    pair = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
