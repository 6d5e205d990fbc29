"""The chat completions body (`/v1/chat/completions`, and the Responses API once read as one) ->
GenerateRequest: the messages, the chat-only fields, tools and the output constraint. The fields it
shares with completions, and how a body is read, are schema.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.services.openai import extensions, legacy_functions, structured, tools
from loraplex.services.openai.errors import bad_request
from loraplex.services.openai.responses import Asked
from loraplex.services.openai.schema import (
    MAX_TOP_LOGPROBS,
    UINT32_MAX,
    CommonFields,
    DoorCall,
    ask_logprobs,
    parse,
    sampling_params,
)
from loraplex.v1 import inference_pb2 as pb

# OpenAI's chat roles, as the server accepts them (services/inference/generate_inputs.py CHAT_ROLES).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


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


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["content"]
    content: str | list[TextPart]


class ChatRequest(CommonFields):
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


def parse_chat(body: Any) -> tuple[ChatRequest, bool]:
    """A chat body parsed, `functions` / `function_call` read as tools first; True when it used them
    (the answer then takes their shape)."""
    legacy = isinstance(body, dict) and legacy_functions.rewrite(body)
    return parse(ChatRequest, body), legacy


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


def chat_request(
    req: ChatRequest, adapter: str, max_new_tokens_limit: int = 0
) -> tuple[pb.GenerateRequest, Asked]:
    """The request without its output constraint and tools (`chat_call` adds them).
    `max_new_tokens_limit`: the server's --max-new-tokens-limit, asked for when the call gives no
    max_tokens (the engine stops at the context first), as OpenAI generates up to the context."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    params = sampling_params(req, req.max_completion_tokens or req.max_tokens or max_new_tokens_limit)
    top = (req.top_logprobs or 0) if req.logprobs else None
    ask_logprobs(params, top, req.prompt_logprobs)
    messages = tools.chat_messages(req.messages)
    request = pb.GenerateRequest(
        inputs=[pb.Input(messages=messages)], adapter=[adapter], sampling_params=params
    )
    request.draft_adapter = req.draft_adapter or ""
    return request, Asked(top, req.prompt_logprobs, token_ids=req.return_tokens_as_token_ids)
