"""OpenAI request bodies -> GenerateRequest. Every field is honoured or refused with 400, never
silently ignored: the models below list what is honoured (OpenAI's fields, vLLM's extensions that the
engine implements, and the structured-output and tool fields), UNSUPPORTED the OpenAI fields refused
when given a value, and any other name is refused as unknown. Values are checked strictly (`true` is
no number). Fields that only label the call (`user`) are accepted."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loraplex.services.openai import extensions, legacy_functions, structured, tools
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
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    # vLLM's: usage on every chunk (its running counts), not only in the last one
    continuous_usage_stats: bool = False
    # OpenAI's: random padding on each delta chunk (the `obfuscation` field) to even out sizes
    include_obfuscation: bool = False


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


class CompletionRequest(_Common):
    # a string, strings, token ids or lists of token ids: checked by `_prompt_inputs`, whose
    # messages name the entry at fault (a union's would name the union's branches)
    prompt: Any
    # OpenAI's default for completions; 0 scores the prompt (with echo), as vLLM allows.
    max_tokens: int | None = Field(default=16, ge=0, le=UINT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) on text prompts
    suffix: str | None = None
    best_of: int | None = None
    response_format: Any = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


# What a message may carry besides role and content: tool fields (services/openai/tools.py reads
# them as extras) and the assistant fields clients send back unchanged (no effect on the prompt).
MESSAGE_EXTRAS = frozenset({"tool_calls", "tool_call_id", "name", "refusal", "annotations"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: ChatRole
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _known_extras(self):
        # null counts as not given (an SDK's message object sends back `"audio": null` and the like)
        for name, value in (self.model_extra or {}).items():
            if name not in MESSAGE_EXTRAS and value is not None:
                raise ValueError(f"unknown field {name[:100]!r} in a message")
        return self


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    # OpenAI's chat-only fields: modalities ["text"] only; `prediction` accepted (no speculation
    # here, so no effect); reasoning_effort / verbosity reach the chat template as variables.
    modalities: list[str] | None = None
    prediction: Prediction | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False  # vLLM's chat default: the template writes them


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["content"]
    content: str | list[TextPart]


ChatRequest.model_rebuild()

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


def parse_chat(body: Any) -> tuple[ChatRequest, bool]:
    """A chat body parsed, `functions` / `function_call` read as tools first; True when it used them
    (the answer then takes their shape)."""
    legacy = isinstance(body, dict) and legacy_functions.rewrite(body)
    return parse(ChatRequest, body), legacy


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
    reply: extensions.ReplyOptions = extensions.ReplyOptions()


def completion_call(req: CompletionRequest, adapter: str) -> DoorCall:
    request, asked = completion_request(req, adapter)
    fields = structured.apply(req, request.sampling_params, req.response_format)
    return DoorCall(request, asked, None, fields, extensions.reply_options(req, chat=False))


def chat_call(
    req: ChatRequest, adapter: str, max_new_tokens_limit: int = 0, legacy_functions: bool = False
) -> DoorCall:
    request, asked = chat_request(req, adapter, max_new_tokens_limit)
    params = request.sampling_params
    extensions.apply_chat(req, request.inputs[0])
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
    reply = extensions.reply_options(req, chat=True, legacy_functions=legacy_functions)
    return DoorCall(request, asked, tool_plan, fields, reply)


def completion_request(req: CompletionRequest, adapter: str) -> tuple[pb.GenerateRequest, Asked]:
    if req.suffix:
        raise bad_request(
            "suffix is not available: this server generates after the prompt only (no insertion)", "suffix"
        )
    if req.best_of is not None and req.best_of < req.n:
        raise bad_request(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
    if req.best_of not in (None, req.n):
        raise bad_request(
            "best_of > n is not available: this server returns every sample it generates (ask n "
            "samples with logprobs and pick on your side)",
            "best_of",
        )
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
    if not req.add_special_tokens:
        for inp in inputs:
            if inp.text:
                inp.add_special_tokens = False
    texts = tuple(i.text or None for i in inputs)
    asked = Asked(
        req.logprobs,
        req.prompt_logprobs,
        req.echo,
        req.max_tokens == 0,
        texts,
        req.return_tokens_as_token_ids,
    )
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
    return request, Asked(top, req.prompt_logprobs, token_ids=req.return_tokens_as_token_ids)
