"""Engine errors → gRPC status codes, with rich `google.rpc.Status` details in the trailer.

The details (BadRequest field violations, ResourceInfo for adapters, RetryInfo where a
retry can help) travel in the standard `grpc-status-details-bin` trailer, so any
language's stubs can read them (grpcio-status in Python).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from loraplex.services.inference import errors

CODE_OF: dict[type[errors.LoraplexError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AdapterInvalid: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    errors.AdapterIncompatible: grpc.StatusCode.FAILED_PRECONDITION,
    errors.CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.BackendUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.NonFiniteLogits: grpc.StatusCode.INTERNAL,
}

# Retrying the same call later can succeed only for these.
RETRY_AFTER_S: dict[grpc.StatusCode, float] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 1.0,
    grpc.StatusCode.UNAVAILABLE: 2.0,
}

ADAPTER_RESOURCE_TYPE = "loraplex.v1.Adapter"


def code_for(exc: errors.LoraplexError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in CODE_OF:
            return CODE_OF[cls]
    return grpc.StatusCode.INTERNAL


def _pack(message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)
    return out


def build_status(
    code: grpc.StatusCode,
    message: str,
    *,
    field: str | None = None,
    adapter: str | None = None,
    info: error_details_pb2.ErrorInfo | None = None,
) -> grpc.Status:
    """A grpc.Status whose trailer carries the rich details for `code`."""
    details: list[any_pb2.Any] = [_pack(info)] if info is not None else []
    if field and code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if adapter:
        details.append(
            _pack(
                error_details_pb2.ResourceInfo(
                    resource_type=ADAPTER_RESOURCE_TYPE, resource_name=adapter, description=message
                )
            )
        )
    if code in RETRY_AFTER_S:
        seconds = RETRY_AFTER_S[code]
        delay = duration_pb2.Duration(seconds=int(seconds), nanos=int((seconds % 1) * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    proto = status_pb2.Status(code=code.value[0], message=message, details=details)
    return rpc_status.to_status(proto)


ERROR_DOMAIN = "loraplex.v1"


def status_for(exc: errors.LoraplexError) -> grpc.Status:
    info = None
    if isinstance(exc, errors.ContextLengthExceeded):
        info = error_details_pb2.ErrorInfo(
            reason=exc.reason,
            domain=ERROR_DOMAIN,
            metadata={"prompt_tokens": str(exc.prompt_tokens), "context_length": str(exc.context_length)},
        )
    return build_status(code_for(exc), exc.message, field=exc.field, adapter=exc.adapter, info=info)


async def abort_with(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """Abort the RPC with `status` (raises, as `context.abort` does)."""
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)


def details_of(error: grpc.RpcError) -> dict[str, object]:
    """Decode the rich details of a received error (used by clients and tests)."""
    out: dict[str, object] = {}
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return out
    for detail in status.details:
        for cls in (
            error_details_pb2.BadRequest,
            error_details_pb2.ResourceInfo,
            error_details_pb2.RetryInfo,
            error_details_pb2.ErrorInfo,
        ):
            if detail.Is(cls.DESCRIPTOR):
                msg = cls()
                detail.Unpack(msg)
                out[cls.DESCRIPTOR.name] = msg
    return out
