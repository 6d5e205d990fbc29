"""GenerateResponse -> OpenAI response bodies, and the helpers stream.py shares to build its chunks."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, NamedTuple

from loraplex.services.openai import logprobs as lp_mod
from loraplex.services.openai.tools import ToolPlan, tool_output
from loraplex.v1 import inference_pb2 as pb

# A Hub reference as LoadAdapter / the store take it: `org/repo` or `hf://org/repo`, maybe `@revision`.
_HUB_ID = re.compile(r"^(hf://)?[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


def public_source(source: str, name: str) -> str:
    """What /v1/models shows as an adapter's `root`: its Hub id, never a local path (which would tell
    any caller how the server's disk is laid out); the adapter's own name otherwise."""
    return source if _HUB_ID.fullmatch(source.strip()) and ".." not in source else name


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str) -> str | None:
    return reason or None  # "stop" | "length" as OpenAI's; "abort" passes through


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Asked(NamedTuple):
    """What the HTTP request asked of the response (chat_schema.py and completion_schema.py fill it
    from the body)."""

    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None = no logprobs
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs
    echo: bool = False  # completions: the prompt leads the text (and its tokens the logprobs)
    score_only: bool = False  # max_tokens 0 with echo: the one token generated is dropped
    prompts: tuple[str | None, ...] = ()  # per input: its text prompt (echo); None when given as ids
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def _usage_of(completions, score_only: bool = False) -> dict[str, Any]:
    # Each input's prompt counts once, however many samples it has (as OpenAI counts n).
    prompts = {c.index: c.prompt_tokens for c in completions}
    cached: dict[int, int] = {}
    for c in completions:
        cached[c.index] = max(cached.get(c.index, 0), c.cached_prompt_tokens)
    generated = 0 if score_only else sum(c.completion_tokens for c in completions)
    return usage(sum(prompts.values()), generated, sum(cached.values()))


def _prompt_bytes(c) -> bytes:
    return c.prompt_first_token_bytes + b"".join(lp_mod.raw(lp) for lp in c.prompt_logprobs)


# `c` below is a Completion, or a stream's GenerateStreamResponse: the same fields carry the same
# things, so a stream's chunks add up to the non-streaming body (prompt ones on a sample's first message).


def generated(c, asked: Asked) -> tuple[str, list, str]:
    """`c`'s generated text, its tokens' log probabilities and its finish reason. Scoring only
    (max_tokens 0) there are none: the engine had to generate one token, the answer drops it and
    finishes "length" (vLLM's convention)."""
    if asked.score_only:
        return "", [], "length" if c.finish_reason else ""
    return c.text, list(c.logprobs), c.finish_reason


def echoed(c, asked: Asked, offsets: lp_mod.TextOffsets, then=()) -> tuple[str, dict[str, list] | None]:
    """What echo puts first: the prompt's text (as the caller wrote it; decoded from its tokens' bytes
    when given as ids) and, with logprobs, the legacy lists of its tokens (the first one's null)
    followed by `then`'s (generated tokens), their text offsets counted by `offsets`."""
    prompt = asked.prompts[c.index] if c.index < len(asked.prompts) else None
    if prompt is None:
        prompt = _prompt_bytes(c).decode("utf-8", errors="replace")
    if asked.logprobs is None:
        return prompt, None
    lps = [*c.prompt_logprobs, *then]
    return prompt, lp_mod.legacy(
        lps, offsets, asked.logprobs, first_prompt_token=c.prompt_first_token_bytes, ids=asked.token_ids
    )


def prompt_fields(c, asked: Asked) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` field when asked for, else nothing."""
    if asked.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": lp_mod.prompt_logprobs(c.prompt_logprobs, asked.prompt_logprobs)}


def _completion_choice(k: int, c, asked: Asked) -> dict[str, Any]:
    text, lps, reason = generated(c, asked)
    logprobs = None
    if asked.echo:
        prompt, logprobs = echoed(c, asked, lp_mod.TextOffsets(), lps)
        text = prompt + text
    elif asked.logprobs is not None:
        logprobs = lp_mod.completion_logprobs(lps, 0, asked.logprobs, asked.token_ids)
    choice = {"index": k, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs}
    return choice | prompt_fields(c, asked)


def completion_body(resp: pb.GenerateResponse, model: str, asked: Asked) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_completion_choice(k, c, asked) for k, c in enumerate(resp.completions)],
        "usage": _usage_of(resp.completions, asked.score_only),
    }


def assistant_message(text: str, reason: str, tool_plan: ToolPlan | None) -> tuple[dict[str, Any], str]:
    """The assistant message and finish reason of one output (tool calls parsed when tools are on)."""
    if tool_plan is None or not tool_plan.parses:
        return {"role": "assistant", "content": text}, reason
    content, calls, reason = tool_output(tool_plan, text, reason)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, reason


def chat_body(
    resp: pb.GenerateResponse, model: str, asked: Asked, tool_plan: ToolPlan | None = None
) -> dict[str, Any]:
    choices = []
    for k, c in enumerate(resp.completions):
        message, reason = assistant_message(c.text, c.finish_reason, tool_plan)
        choices.append(
            {
                "index": k,
                "message": message,
                "finish_reason": finish_reason(reason),
                "logprobs": lp_mod.chat_logprobs(c.logprobs, asked.logprobs, asked.token_ids)
                if asked.logprobs is not None
                else None,
            }
        )
    body = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage_of(resp.completions),
    }
    if resp.completions:  # vLLM: one prompt_logprobs list for the one prompt, beside the choices
        body |= prompt_fields(resp.completions[0], asked)
    return body
