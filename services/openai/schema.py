"""OpenAI request bodies -> GenerateRequest. Fields we cannot honour are refused with 400,
never silently ignored; fields that only label the call (`user`) are accepted."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.services.openai import structured, tools
from loraplex.services.openai.errors import bad_request
from loraplex.v1 import inference_pb2 as pb

MAX_TOP_LOGPROBS = 20
UINT32_MAX = (1 << 32) - 1
# OpenAI's chat roles, as the server accepts them (services/inference/generate_inputs.py CHAT_ROLES).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
# Strict: `true` is no number and 1.0 no integer (a number where a float goes is fine).
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
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
    # a string, strings, token ids or lists of token ids: checked by `_prompt_inputs`, whose
    # messages name the entry at fault (a union's would name the union's branches)
    prompt: Any
    max_tokens: int | None = Field(default=16, ge=1, le=UINT32_MAX)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: ChatRole
    content: str | list[TextPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
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


# What pydantic puts in an error's location for a union's branch: not a field of the request.
_UNION_BRANCHES = {"str", "int", "float", "bool", "none", "dict", "list"}


def field_param(loc: tuple[str | int, ...]) -> str | None:
    """OpenAI's spelling of a pydantic error location: ('messages', 0, 'content', 'str') ->
    messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_BRANCHES or "[" in part or "-" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def parse(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # the deepest location: in a union, the branch the value got furthest into
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = field_param(first["loc"])
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
    inputs = _prompt_inputs(req.prompt)
    return pb.GenerateRequest(inputs=inputs, adapter=[adapter], sampling_params=params)


PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_inputs(prompt: Any) -> list[pb.Input]:
    """`prompt` in each of its four forms -> one Input per prompt; nothing empty, no `true` as an id."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [pb.Input(text=prompt)]
    if not isinstance(prompt, list):
        raise bad_request(f"prompt must be {PROMPT_FORMS}", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        for i, p in enumerate(prompt):
            if not p:
                raise bad_request(f"prompt[{i}] must not be empty", "prompt")
        return [pb.Input(text=p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [pb.Input(token_ids=_ids(p, f"prompt[{i}]")) for i, p in enumerate(prompt)]
    if any(isinstance(p, int | bool) for p in prompt):
        return [pb.Input(token_ids=_ids(prompt, "prompt"))]
    raise bad_request(f"prompt must be {PROMPT_FORMS}", "prompt")


def _ids(ids: list[Any], where: str) -> list[int]:
    if not ids:
        raise bad_request(f"{where} must not be empty", "prompt")
    for j, i in enumerate(ids):
        if not _is_id(i):
            raise bad_request(f"{where}[{j}] is {json.dumps(i)[:40]}, not an integer token id", "prompt")
        if not 0 <= i <= UINT32_MAX:
            raise bad_request(
                f"{where}[{j}] is {i}: a token id is an integer in [0, {UINT32_MAX}]"
                " (and below the model's vocabulary size)",
                "prompt",
            )
    return ids


def chat_request(req: ChatRequest, adapter: str) -> pb.GenerateRequest:
    """The request without its output constraint and tools (`chat_call` adds them)."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = _sampling(req, req.max_completion_tokens or req.max_tokens)
    if req.logprobs:
        params.logprobs, params.top_logprobs = True, req.top_logprobs or 0
    messages = tools.chat_messages(req.messages)
    return pb.GenerateRequest(inputs=[pb.Input(messages=messages)], adapter=[adapter], sampling_params=params)
