"""OpenAI request bodies -> GenerateRequest. Every field is honoured or refused with 400, never
silently ignored: the models below list what is honoured (OpenAI's fields, and vLLM's extensions
that the engine implements), UNSUPPORTED the OpenAI fields refused when given a value, and any
other name is refused as unknown. Fields that only label the call (`user`) are accepted."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.services.openai.errors import OpenAIError, bad_request
from loraplex.services.openai.responses import Asked
from loraplex.v1 import inference_pb2 as pb

MAX_TOP_LOGPROBS = 20
UINT32 = (1 << 32) - 1


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # Unknown names never reach here (`parse` refuses them first); forbid is the backstop.
    model_config = ConfigDict(extra="forbid")

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
    # vLLM's extensions, as vLLM defines them (top_k -1 or 0 = off).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions; 0 scores the prompt (with echo), as vLLM allows.
    max_tokens: int | None = Field(default=16, ge=0)
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
    response_format: dict[str, Any] | None = None


# OpenAI fields this server does not implement: refused when given a value. null, [] and {} count
# as not given (SDKs and frameworks send them so). Add a name here, or a field to a model above.
UNSUPPORTED = frozenset(
    {
        "functions",
        "function_call",
        "tool_choice",
        "parallel_tool_calls",
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


def parse(model: type[BaseModel], body: Any):
    try:
        return model.model_validate(check_fields(model, body))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _sampling(req: _Common, max_tokens: int | None) -> pb.SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t <= UINT32 for t in stop_ids):
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


def _no_stream(req: _Common, name: str) -> None:
    if req.stream:
        raise bad_request(f"{name} with stream is not supported by this server", name)


def completion_request(req: CompletionRequest, adapter: str) -> tuple[pb.GenerateRequest, Asked]:
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of not in (None, req.n):
        raise bad_request("best_of is not supported by this server (only best_of = n)", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 scores the prompt: it needs echo: true", "max_tokens")
    if req.echo:
        _no_stream(req, "echo")
    if req.prompt_logprobs is not None:
        _no_stream(req, "prompt_logprobs")
    # max_tokens 0: the engine always generates one token; the answer leaves it out.
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # null: OpenAI's default too
    params = _sampling(req, 1 if max_tokens == 0 else max_tokens)
    # echo needs the prompt's tokens (their bytes come with the prompt log probabilities).
    _logprobs(
        params,
        req.logprobs,
        req.prompt_logprobs if not req.echo else max(req.logprobs or 0, req.prompt_logprobs or 0),
    )
    prompt = req.prompt
    if isinstance(prompt, str):
        inputs, texts = [pb.Input(text=prompt)], (prompt,)
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, int) for p in prompt):
        inputs, texts = [pb.Input(token_ids=_ids(prompt))], (None,)
    elif all(isinstance(p, str) for p in prompt):
        inputs, texts = [pb.Input(text=p) for p in prompt], tuple(prompt)
    else:
        inputs = [pb.Input(token_ids=_ids(p)) for p in prompt]
        texts = (None,) * len(inputs)
    asked = Asked(req.logprobs, req.prompt_logprobs, req.echo, req.max_tokens == 0, texts)
    return pb.GenerateRequest(inputs=inputs, adapter=[adapter], sampling_params=params), asked


def _ids(ids: list[int]) -> list[int]:
    if not ids:
        raise bad_request("prompt must not contain an empty list of token ids", "prompt")
    if any(i < 0 or i > UINT32 for i in ids):
        raise bad_request("prompt token ids must be non-negative", "prompt")
    return ids


def chat_request(
    req: ChatRequest, adapter: str, max_new_tokens_limit: int = 0
) -> tuple[pb.GenerateRequest, Asked]:
    """`max_new_tokens_limit`: the server's --max-new-tokens-limit, asked for when the call gives no
    max_tokens (the engine stops at the context first), as OpenAI generates up to the context."""
    if req.tools:
        raise bad_request("tools are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request(
            "response_format other than text is not supported by this server", "response_format"
        )
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if req.prompt_logprobs is not None:
        _no_stream(req, "prompt_logprobs")
    params = _sampling(req, req.max_completion_tokens or req.max_tokens or max_new_tokens_limit)
    top = (req.top_logprobs or 0) if req.logprobs else None
    _logprobs(params, top, req.prompt_logprobs)
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if not m.role:
            raise OpenAIError(400, f"messages[{i}].role must not be empty", param=f"messages.{i}.role")
        messages.append(pb.ChatMessage(role=m.role, content=content))
    asked = Asked(top, req.prompt_logprobs)
    request = pb.GenerateRequest(
        inputs=[pb.Input(messages=messages)], adapter=[adapter], sampling_params=params
    )
    return request, asked
