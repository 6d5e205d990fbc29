"""OpenAI request bodies -> GenerateRequest. Fields we cannot honour are refused with 400,
never silently ignored; fields that only label the call (`user`) are accepted."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.services.openai import structured, tools
from loraplex.services.openai.errors import OpenAIError, bad_request
from loraplex.v1 import inference_pb2 as pb

MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's structured-output extensions (services/openai/structured.py reads and checks them).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None


UNSUPPORTED_EXTRAS = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


def parse(model: type[BaseModel], body: Any):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _sampling(req: _Common, max_tokens: int | None) -> pb.SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    for name in UNSUPPORTED_EXTRAS:
        if (req.model_extra or {}).get(name) not in (None, [], {}):
            raise bad_request(f"{name} is not supported by this server", name)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = pb.SamplingParams(
        max_new_tokens=max_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default is 1
        top_p=req.top_p or 0.0,
        n=req.n,
        stop=stop,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
    )
    if req.seed is not None:
        params.seed = req.seed & ((1 << 64) - 1)
    return params


class DoorCall(NamedTuple):
    """A request as sent on, with what the answer needs: the tool plan (chat with tools) and the
    constraint's field names, to name the caller's field in a compile error."""

    request: pb.GenerateRequest
    tool_plan: tools.ToolPlan | None = None
    fields: dict[str, str] = {}  # noqa: RUF012 - never mutated


def completion_call(req: CompletionRequest, adapter: str) -> DoorCall:
    request = completion_request(req, adapter)
    return DoorCall(request, None, structured.apply(req, request.sampling_params))


def chat_call(req: ChatRequest, adapter: str) -> DoorCall:
    request = chat_request(req, adapter)
    params = request.sampling_params
    fields = structured.apply(req, params, req.response_format)
    tool_plan = tools.plan(req.tools, req.tool_choice)
    if tool_plan is not None:
        if fields and tool_plan.mode in ("required", "named"):
            raise bad_request(
                f"tool_choice {tool_plan.mode} already constrains the output; "
                f"drop {next(iter(fields.values()))}",
                "tool_choice",
            )
        fields = fields or tools.constrain(tool_plan, params)
        request.inputs[0].tools_json = tools.tools_json(tool_plan.tools)
    return DoorCall(request, tool_plan, fields)


def completion_request(req: CompletionRequest, adapter: str) -> pb.GenerateRequest:
    if req.echo:
        raise bad_request("echo is not supported by this server", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of is not supported by this server (only best_of = n)", "best_of")
    params = _sampling(req, req.max_tokens)
    if req.logprobs is not None:
        params.logprobs, params.top_logprobs = True, req.logprobs
    prompt = req.prompt
    if isinstance(prompt, str):
        inputs = [pb.Input(text=prompt)]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        inputs = [pb.Input(token_ids=_ids(prompt))]
    elif all(isinstance(p, str) for p in prompt):
        inputs = [pb.Input(text=p) for p in prompt]
    else:
        inputs = [pb.Input(token_ids=_ids(p)) for p in prompt]
    return pb.GenerateRequest(inputs=inputs, adapter=[adapter], sampling_params=params)


def _ids(ids: list[int]) -> list[int]:
    if any(i < 0 or i >= 1 << 32 for i in ids):
        raise bad_request("prompt token ids must be non-negative", "prompt")
    return ids


def chat_request(req: ChatRequest, adapter: str) -> pb.GenerateRequest:
    """The request without its output constraint and tools (`chat_call` adds them)."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = _sampling(req, req.max_completion_tokens or req.max_tokens)
    if req.logprobs:
        params.logprobs, params.top_logprobs = True, req.top_logprobs or 0
    for i, m in enumerate(req.messages):
        if not m.role:
            raise OpenAIError(400, f"messages[{i}].role must not be empty", param=f"messages.{i}.role")
    messages = tools.chat_messages(req.messages)
    return pb.GenerateRequest(inputs=[pb.Input(messages=messages)], adapter=[adapter], sampling_params=params)
