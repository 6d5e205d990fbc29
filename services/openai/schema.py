"""OpenAI request bodies -> GenerateRequest. Every field is honoured or refused with 400, never
silently ignored: the models below list what is honoured (OpenAI's fields, vLLM's extensions that the
engine implements, and the structured-output and tool fields), UNSUPPORTED the OpenAI fields refused
when given a value, and any other name is refused as unknown. Values are checked strictly (`true` is
no number). Fields that only label the call (`user`) are accepted."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.services.openai import structured, tools
from loraplex.services.openai.errors import bad_request
from loraplex.services.openai.responses import Asked
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
    # Unknown names never reach here (`parse` refuses them first); forbid is the backstop.
    model_config = ConfigDict(extra="forbid", strict=True)

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
    # vLLM's extensions, as vLLM defines them (top_k -1 or 0 = off).
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's structured-output extensions (services/openai/structured.py reads and checks them).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # loraplex's: the draft model's adapter (--speculative-draft-lora-paths), sent as draft_adapter.
    draft_adapter: str | None = None


class CompletionRequest(_Common):
    # a string, strings, token ids or lists of token ids: checked by `_prompt_inputs`, whose
    # messages name the entry at fault (a union's would name the union's branches)
    prompt: Any
    # OpenAI's default for completions; 0 scores the prompt (with echo), as vLLM allows.
    max_tokens: int | None = Field(default=16, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # tool_calls, tool_call_id and name travel as extras (services/openai/tools.py reads them)
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


# OpenAI fields this server does not implement: refused when given a value. null, [] and {} count
# as not given (SDKs and frameworks send them so). Add a name here, or a field to a model above.
UNSUPPORTED = frozenset(
    {
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "service_tier",
        "store",
        "metadata",
    }
)


def check_fields(model: type[BaseModel], body: Any) -> Any:
    """`body` without the unsupported fields left empty; 400 naming the first field this server
    neither honours nor knows."""
    if not isinstance(body, dict):
        return body
    known = model.model_fields
    out = {}
    for name, value in body.items():
        if name in known:
            out[name] = value
        elif name in UNSUPPORTED:
            if value not in (None, [], {}):
                raise bad_request(f"{name} is not supported by this server", name)
        else:
            raise bad_request(
                f"unknown field {name[:100]!r}: this server honours OpenAI's fields and vLLM's extensions "
                "listed in docs/operations.md; it ignores none",
                name[:100],
            )
    return out


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
        return model.model_validate(check_fields(model, body))
    except ValidationError as exc:
        # the deepest location: in a union, the branch the value got furthest into
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = field_param(first["loc"])
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _sampling(req: _Common, max_tokens: int | None) -> pb.SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t <= UINT32_MAX for t in stop_ids):
        raise bad_request("stop_token_ids must be token ids (non-negative)", "stop_token_ids")
    params = pb.SamplingParams(
        max_new_tokens=max_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default is 1
        top_p=req.top_p or 0.0,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 0.0,
        n=req.n,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
    )
    if req.skip_special_tokens is not None:
        params.skip_special_tokens = req.skip_special_tokens
    if req.seed is not None:
        params.seed = req.seed & ((1 << 64) - 1)
    return params


def _logprobs(params: pb.SamplingParams, generated: int | None, prompt: int | None) -> None:
    """One `top_logprobs` serves both kinds in the proto: ask the larger, the door trims each."""
    if generated is not None:
        params.logprobs = True
    if prompt is not None:
        params.prompt_logprobs = True
    params.top_logprobs = max(generated or 0, prompt or 0)


class DoorCall(NamedTuple):
    """A request as sent on, with what the answer needs: which log probabilities were asked for
    (and echo), the tool plan (chat with tools) and the constraint's field names, to name the
    caller's field in a compile error."""

    request: pb.GenerateRequest
    asked: Asked
    tool_plan: tools.ToolPlan | None = None
    fields: dict[str, str] = {}  # noqa: RUF012 - never mutated


def completion_call(req: CompletionRequest, adapter: str) -> DoorCall:
    request, asked = completion_request(req, adapter)
    return DoorCall(request, asked, None, structured.apply(req, request.sampling_params))


def chat_call(req: ChatRequest, adapter: str, max_new_tokens_limit: int = 0) -> DoorCall:
    request, asked = chat_request(req, adapter, max_new_tokens_limit)
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
    return DoorCall(request, asked, tool_plan, fields)


def completion_request(req: CompletionRequest, adapter: str) -> tuple[pb.GenerateRequest, Asked]:
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of is not supported by this server (only best_of = n)", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 scores the prompt: it needs echo: true", "max_tokens")
    # max_tokens 0: the engine always generates one token; the answer leaves it out.
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # null: OpenAI's default too
    params = _sampling(req, 1 if max_tokens == 0 else max_tokens)
    # echo needs the prompt's tokens (their bytes come with the prompt log probabilities).
    _logprobs(
        params,
        req.logprobs,
        req.prompt_logprobs if not req.echo else max(req.logprobs or 0, req.prompt_logprobs or 0),
    )
    inputs = _prompt_inputs(req.prompt)
    texts = tuple(i.text or None for i in inputs)
    asked = Asked(req.logprobs, req.prompt_logprobs, req.echo, req.max_tokens == 0, texts)
    request = pb.GenerateRequest(inputs=inputs, adapter=[adapter], sampling_params=params)
    request.draft_adapter = req.draft_adapter or ""
    return request, asked


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


def chat_request(
    req: ChatRequest, adapter: str, max_new_tokens_limit: int = 0
) -> tuple[pb.GenerateRequest, Asked]:
    """The request without its output constraint and tools (`chat_call` adds them).
    `max_new_tokens_limit`: the server's --max-new-tokens-limit, asked for when the call gives no
    max_tokens (the engine stops at the context first), as OpenAI generates up to the context."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = _sampling(req, req.max_completion_tokens or req.max_tokens or max_new_tokens_limit)
    top = (req.top_logprobs or 0) if req.logprobs else None
    _logprobs(params, top, req.prompt_logprobs)
    messages = tools.chat_messages(req.messages)
    request = pb.GenerateRequest(
        inputs=[pb.Input(messages=messages)], adapter=[adapter], sampling_params=params
    )
    request.draft_adapter = req.draft_adapter or ""
    return request, Asked(top, req.prompt_logprobs)
