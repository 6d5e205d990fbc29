"""Errors in OpenAI's JSON shape, with the HTTP status that matches the gRPC status behind them."""

from __future__ import annotations

import re

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from starlette.responses import JSONResponse

HTTP_OF: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.CANCELLED: (499, "server_error"),
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"retry-after": str(max(1, round(self.retry_after)))} if self.retry_after else None
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist: name the base model or an adapter (GET /v1/models lists them)",
        param="model",
        code="model_not_found",
    )


# gRPC SamplingParams fields -> the HTTP request's names (the rest keep their name).
SAMPLING_PARAM = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}


def request_param(field: str, chat: bool) -> str:
    """The HTTP request's field for a gRPC field violation: `sampling_params.max_new_tokens` ->
    `max_tokens`, `inputs[0]` / `text[0]` -> `prompt` (or `messages`), `inputs[0].messages[2].role`
    -> `messages[2].role`, `inputs[0].tools_json` -> `tools`."""
    if field.startswith("adapter") or field.endswith(".adapter"):
        return "model"
    field = re.sub(r"^inputs\[\d+\]\.(?=sampling_params)", "", field)
    if field.startswith("sampling_params."):
        name = field.split(".", 1)[1]
        if chat and name == "top_logprobs":
            return "top_logprobs"
        return SAMPLING_PARAM.get(name, name)
    chat_field = re.match(r"^inputs\[\d+\]\.(chat_template_kwargs|continue_final_message)", field)
    if chat_field:
        return chat_field.group(1)
    message = re.match(r"^inputs\[\d+\]\.messages\[(\d+)\](.*)$", field)
    if message:  # the door's spelling (pydantic's errors read the same): messages[2].tool_calls
        rest = re.sub(r"^\.tool_calls_json", ".tool_calls", message.group(2))
        return f"messages[{message.group(1)}]{rest}"
    if re.match(r"^inputs\[\d+\]\.tools_json", field):
        return "tools"
    if re.match(r"^(inputs|text)(\[\d+\]|$)", field):
        return "messages" if chat else "prompt"
    return field


def context_length_exceeded(prompt_tokens: int, context_length: int, chat: bool) -> OpenAIError:
    """OpenAI's error for a prompt the context cannot hold (clients such as litellm match its code)."""
    what = "messages" if chat else "prompt"
    counted = f"{prompt_tokens} tokens" if prompt_tokens else f"more than {context_length} tokens"
    return OpenAIError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, your {what} "
        f"resulted in {counted} (at least one more is needed for the completion). "
        f"Please reduce the length of the {what}.",
        param="messages" if chat else "prompt",
        code="context_length_exceeded",
    )


def _details(error: grpc.RpcError) -> tuple[list[str], float | None, error_details_pb2.ErrorInfo | None]:
    """The fields a BadRequest detail names, a RetryInfo delay and an ErrorInfo, when the server sent them."""
    fields: list[str] = []
    retry = None
    info = None
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError, TypeError):
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            msg = error_details_pb2.BadRequest()
            detail.Unpack(msg)
            fields.extend(v.field for v in msg.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            msg = error_details_pb2.RetryInfo()
            detail.Unpack(msg)
            retry = msg.retry_delay.seconds + msg.retry_delay.nanos / 1e9
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
    return fields, retry, info


def _message_too_large(error: grpc.RpcError) -> bool:
    """grpc's own size limit (client or server side): the request is too big, which no retry fixes,
    not a full queue (429 would have SDKs retry it for ever)."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in (
        error.details() or ""
    )


def from_grpc(error: grpc.RpcError, model: str, chat: bool = False) -> OpenAIError:
    """The OpenAI error for a failed gRPC call made for `model` (by a chat call when `chat`), its
    `param` the HTTP request's field."""
    code = error.code()
    if _message_too_large(error):
        return OpenAIError(
            413,
            f"the request is larger than the server accepts ({error.details()}): lower --max-body-bytes "
            "to the server's --max-message-bytes, or send less",
            code="request_too_large",
        )
    fields, retry_after, info = _details(error)
    if info is not None and info.reason == "CONTEXT_LENGTH_EXCEEDED":
        try:
            prompt, context = int(info.metadata["prompt_tokens"]), int(info.metadata["context_length"])
        except (KeyError, ValueError):
            pass
        else:
            return context_length_exceeded(prompt, context, chat)
    message = error.details() or code.name
    if code == grpc.StatusCode.INTERNAL and "RST_STREAM" in message:
        # The router reset the stream: the replica behind it died mid-call. A lost replica, not a bug.
        code, message = (
            grpc.StatusCode.UNAVAILABLE,
            f"the replica serving the call went away; retry ({message})",
        )
    if code == grpc.StatusCode.NOT_FOUND or (
        code == grpc.StatusCode.INVALID_ARGUMENT and any(f.endswith("adapter") for f in fields)
    ):
        return model_not_found(model)
    status, type_ = HTTP_OF.get(code, (500, "server_error"))
    param = request_param(fields[0], chat) if fields else None
    if param is not None:  # say it in the request's words
        message = message.replace(fields[0], param)
    if fields and fields[0].endswith("sampling_params.min_tokens"):  # "must be in [0, max_new_tokens]"
        message = message.replace("max_new_tokens", "max_tokens")
    return OpenAIError(
        status,
        message,
        type_=type_,
        param=param,
        code=code.name.lower(),
        retry_after=retry_after,
    )
