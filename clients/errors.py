"""Typed exceptions for the Python client, one per gRPC status the services return.

Each carries the status code, the server's message and the rich `google.rpc.Status`
details (field violations, the adapter named, a retry delay) when the server sent them.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class LoraplexError(Exception):
    """Base class of every error the client raises for a failed RPC."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field_violations: dict[str, str] | None = None,
        resource: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field_violations = field_violations or {}
        self.resource = resource
        self.retry_after_s = retry_after_s


class InvalidArgument(LoraplexError):
    """The request (or the adapter's files) is malformed; fix it, do not retry."""


class NotFound(LoraplexError):
    """No adapter of that name here nor in the store."""


class FailedPrecondition(LoraplexError):
    """The adapter does not fit this server (rank, target modules, base model)."""


class ResourceExhausted(LoraplexError):
    """A queue or pool is full; `retry_after_s` says when to try again."""


class Unavailable(LoraplexError):
    """The server is loading, draining, or a dependency (store, Redis) is down; retry."""


class DeadlineExceeded(LoraplexError):
    """The call's deadline passed; the server aborted the work."""


class Cancelled(LoraplexError):
    """The call was cancelled."""


class Unimplemented(LoraplexError):
    """The server does not implement this RPC (yet)."""


class InternalError(LoraplexError):
    """Anything else: a server bug."""


ERROR_OF: dict[grpc.StatusCode, type[LoraplexError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def from_rpc_error(err: grpc.RpcError) -> LoraplexError:
    """The typed exception for a failed call, with its rich details decoded."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    message = err.details() if callable(getattr(err, "details", None)) else str(err)
    violations: dict[str, str] = {}
    resource = None
    retry = None
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            msg = error_details_pb2.BadRequest()
            detail.Unpack(msg)
            violations.update({v.field: v.description for v in msg.field_violations})
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            msg = error_details_pb2.ResourceInfo()
            detail.Unpack(msg)
            resource = msg.resource_name
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            msg = error_details_pb2.RetryInfo()
            detail.Unpack(msg)
            retry = msg.retry_delay.seconds + msg.retry_delay.nanos / 1e9
    if replica_went_away(code, message or ""):
        # A proxy (the router) reset the stream because the replica behind it died mid-call: the
        # call never finished, so it is UNAVAILABLE like any other lost replica, not a server bug.
        code = grpc.StatusCode.UNAVAILABLE
        message = f"the replica serving the call went away mid-call; retry ({message})"
    cls = ERROR_OF.get(code, InternalError)
    return cls(code, message or "", field_violations=violations, resource=resource, retry_after_s=retry)


def replica_went_away(code: grpc.StatusCode, message: str) -> bool:
    """INTERNAL "RST_STREAM with error code 2" is what grpc reports when a proxy resets the
    stream after its upstream died; loraplex itself never answers INTERNAL that way.

    Safe to retry: Generate (nothing was returned), GetModelInfo, ListAdapters, Tokenize, Detokenize,
    LoadAdapter (same name and source give the same adapter). GenerateStream only when no message
    had arrived yet; after that, a retry regenerates text the caller already has."""
    return code == grpc.StatusCode.INTERNAL and "RST_STREAM" in message
