"""The completions body (`/v1/completions`) -> GenerateRequest: the prompt in each of its four
forms, echo and prompt scoring, and the completions-only fields refused with the reason. The fields
it shares with chat, and how a body is read, are schema.py's."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from loraplex.services.openai import extensions, structured
from loraplex.services.openai.errors import bad_request
from loraplex.services.openai.responses import Asked
from loraplex.services.openai.schema import (
    MAX_TOP_LOGPROBS,
    UINT32_MAX,
    CommonFields,
    DoorCall,
    ask_logprobs,
    sampling_params,
)
from loraplex.v1 import inference_pb2 as pb


class CompletionRequest(CommonFields):
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


def completion_call(req: CompletionRequest, adapter: str) -> DoorCall:
    request, asked = completion_request(req, adapter)
    fields = structured.apply(req, request.sampling_params, req.response_format)
    return DoorCall(request, asked, None, fields, extensions.reply_options(req, chat=False))


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
    params = sampling_params(req, 1 if max_tokens == 0 else max_tokens)
    # echo needs the prompt's tokens (their bytes come with the prompt log probabilities).
    ask_logprobs(
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
