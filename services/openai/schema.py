"""What every OpenAI request body shares, and how a body is read. Every field is honoured or refused
with 400, never silently ignored: the models (here `CommonFields`, the chat and completions bodies in
chat_schema.py and completion_schema.py) list what is honoured (OpenAI's fields, vLLM's extensions
that the engine implements, and the structured-output and tool fields), UNSUPPORTED the OpenAI fields
refused when given a value, and any other name is refused as unknown. Values are checked strictly
(`true` is no number). Fields that only label the call (`user`) are accepted.

Here: the shared fields, `parse` (body -> model, pydantic's errors in OpenAI's words), the shared
fields -> SamplingParams, and `DoorCall`, what either route sends on."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loraplex.services.openai import extensions, tools
from loraplex.services.openai.errors import bad_request
from loraplex.services.openai.responses import Asked
from loraplex.v1 import inference_pb2 as pb

MAX_TOP_LOGPROBS = 20
UINT32_MAX = (1 << 32) - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    # vLLM's: usage on every chunk (its running counts), not only in the last one
    continuous_usage_stats: bool = False
    # OpenAI's: random padding on each delta chunk (the `obfuscation` field) to even out sizes
    include_obfuscation: bool = False


class CommonFields(BaseModel):
    """The fields of both completions and chat bodies."""

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
    # Advisory (docs/operations.md says what each means here): labels, caching and storage hints.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # vLLM's extensions, as vLLM defines them (top_k -1 or 0 = off).
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = Field(default=0, ge=-(1 << 31), le=(1 << 31) - 1)
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool = False
    spaces_between_special_tokens: bool = True
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's structured-output extensions (services/openai/structured.py reads and checks them).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # loraplex's: the draft model's adapter (--speculative-draft-lora-paths), sent as draft_adapter.
    draft_adapter: str | None = None


# OpenAI fields this server cannot give: refused, with the reason, when given a value. null, []
# and {} count as not given (SDKs and frameworks send them so). `functions` / `function_call` are
# rewritten as tools before parsing (services/openai/legacy_functions.py).
UNSUPPORTED = {
    "audio": "audio output is not available: this server generates text only",
    "web_search_options": "web search is not available on this server",
}


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
                raise bad_request(f"{name} is not supported: {UNSUPPORTED[name]}", name)
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


def sampling_params(req: CommonFields, max_tokens: int | None) -> pb.SamplingParams:
    """The shared fields -> SamplingParams; each route sets its own max_tokens and log probabilities."""
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
    extensions.apply_sampling(req, params)
    return params


def ask_logprobs(params: pb.SamplingParams, generated: int | None, prompt: int | None) -> None:
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
    reply: extensions.ReplyOptions = extensions.ReplyOptions()
