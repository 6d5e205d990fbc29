"""A replica killed mid-stream behind the router reaches clients as INTERNAL "RST_STREAM with
error code 2" (grpc's words for a proxy's reset): the client reports it as UNAVAILABLE (issue 32,
item 8); a genuine INTERNAL stays an InternalError."""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError, Metadata

from loraplex.clients.errors import InternalError, Unavailable, from_rpc_error


def rpc_error(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details)


def test_proxy_reset_is_unavailable():
    error = from_rpc_error(rpc_error(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"))
    assert isinstance(error, Unavailable) and error.code == grpc.StatusCode.UNAVAILABLE
    assert "went away" in error.message and "RST_STREAM" in error.message


def test_other_internal_errors_stay_internal():
    error = from_rpc_error(rpc_error(grpc.StatusCode.INTERNAL, "internal error: KeyError: 'x'"))
    assert isinstance(error, InternalError) and error.code == grpc.StatusCode.INTERNAL


def test_the_door_answers_a_proxy_reset_with_503():
    from loraplex.services.openai.errors import from_grpc

    error = from_grpc(rpc_error(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"), "m")
    assert error.status == 503 and error.code == "unavailable"
    other = from_grpc(rpc_error(grpc.StatusCode.INTERNAL, "internal error: KeyError"), "m")
    assert other.status == 500
