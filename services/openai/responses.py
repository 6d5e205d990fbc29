"""GenerateResponse / GenerateStreamResponse -> OpenAI response bodies and stream chunks."""

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
    """What the HTTP request asked of the response (schema.py fills it from the body)."""

    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None = no logprobs
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs
    echo: bool = False  # completions: the prompt leads the text (and its tokens the logprobs)
    score_only: bool = False  # max_tokens 0 with echo: the one token generated is dropped
    prompts: tuple[str | None, ...] = ()  # per input: its text prompt (echo); None when given as ids


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


def _completion_choice(k: int, c, asked: Asked) -> dict[str, Any]:
    text, generated = c.text, list(c.logprobs)
    reason = finish_reason(c.finish_reason)
    if asked.score_only:
        text, generated, reason = "", [], "length"
    logprobs = None
    if asked.echo:
        prompt = asked.prompts[c.index] if c.index < len(asked.prompts) else None
        if prompt is None:
            prompt = _prompt_bytes(c).decode("utf-8", errors="replace")
        text = prompt + text
        if asked.logprobs is not None:
            logprobs = lp_mod.legacy(
                [*c.prompt_logprobs, *generated],
                lp_mod.TextOffsets(),
                asked.logprobs,
                first_prompt_token=c.prompt_first_token_bytes,
            )
    elif asked.logprobs is not None:
        logprobs = lp_mod.completion_logprobs(generated, 0, asked.logprobs)
    choice = {"index": k, "text": text, "finish_reason": reason, "logprobs": logprobs}
    if asked.prompt_logprobs is not None:
        choice["prompt_logprobs"] = lp_mod.prompt_logprobs(c.prompt_logprobs, asked.prompt_logprobs)
    return choice


def completion_body(resp: pb.GenerateResponse, model: str, asked: Asked) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_completion_choice(k, c, asked) for k, c in enumerate(resp.completions)],
        "usage": _usage_of(resp.completions, asked.score_only),
    }


def _message(text: str, reason: str, tool_plan: ToolPlan | None) -> tuple[dict[str, Any], str]:
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
        message, reason = _message(c.text, c.finish_reason, tool_plan)
        choices.append(
            {
                "index": k,
                "message": message,
                "finish_reason": finish_reason(reason),
                "logprobs": lp_mod.chat_logprobs(c.logprobs, asked.logprobs)
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
    if asked.prompt_logprobs is not None and resp.completions:  # vLLM: one list for the one prompt
        body["prompt_logprobs"] = lp_mod.prompt_logprobs(
            resp.completions[0].prompt_logprobs, asked.prompt_logprobs
        )
    return body


class StreamState:
    """Builds the chunks of one streamed call: choice index = input * n + sample, as OpenAI numbers them."""

    def __init__(self, model: str, n: int, chat: bool, asked: Asked, tool_plan: ToolPlan | None = None):
        self.id = new_id("chatcmpl" if chat else "cmpl")
        # With tools (other than "none"): each choice's text is held until it ends (tools.py says why).
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parses else None
        self.held_text: dict[int, list[str]] = {}
        self.held_logprobs: dict[int, list] = {}
        self.created = int(time.time())
        self.model, self.n, self.chat, self.asked = model, n, chat, asked
        self.started: set[int] = set()
        self.text_offset: dict[int, lp_mod.TextOffsets] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunks(self, msg: pb.GenerateStreamResponse) -> list[dict[str, Any]]:
        k = msg.index * self.n + msg.sample
        out = []
        if msg.finish_reason:
            self.prompt_tokens[msg.index] = msg.prompt_tokens
            self.cached_tokens[msg.index] = max(
                self.cached_tokens.get(msg.index, 0), msg.cached_prompt_tokens
            )
            self.completion_tokens += msg.completion_tokens
        if self.chat:
            if k not in self.started:
                self.started.add(k)
                out.append(
                    self._chunk(
                        [
                            {
                                "index": k,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            if self.tool_plan is not None and self.tool_plan.mode == "named":
                out.extend(self._named_call_chunks(k, msg))
                return out
            if self.tool_plan is not None:
                self.held_text.setdefault(k, []).append(msg.text)
                self.held_logprobs.setdefault(k, []).extend(msg.logprobs)
                if msg.finish_reason:
                    out.extend(self._tool_chunks(k, msg.finish_reason))
                return out
            if msg.text or msg.logprobs:
                k_top = self.asked.logprobs
                lps = lp_mod.chat_logprobs(msg.logprobs, k_top) if k_top is not None else None
                out.append(
                    self._chunk(
                        [{"index": k, "delta": {"content": msg.text}, "logprobs": lps, "finish_reason": None}]
                    )
                )
            if msg.finish_reason:
                out.append(
                    self._chunk(
                        [
                            {
                                "index": k,
                                "delta": {},
                                "logprobs": None,
                                "finish_reason": finish_reason(msg.finish_reason),
                            }
                        ]
                    )
                )
            return out
        offsets = self.text_offset.setdefault(k, lp_mod.TextOffsets())
        if msg.text or msg.logprobs or msg.finish_reason:
            lps = None
            if self.asked.logprobs is not None:
                lps = lp_mod.legacy(msg.logprobs, offsets, self.asked.logprobs)
            out.append(
                self._chunk(
                    [
                        {
                            "index": k,
                            "text": msg.text,
                            "logprobs": lps,
                            "finish_reason": finish_reason(msg.finish_reason),
                        }
                    ]
                )
            )
        return out

    def _named_call_chunks(self, k: int, msg: pb.GenerateStreamResponse) -> list[dict[str, Any]]:
        """A forced function streams as OpenAI streams a call: its id and name first, then the
        arguments as they are generated (the output is the arguments)."""
        out = []
        if k not in self.held_text:  # first message of this choice: the call's header
            self.held_text[k] = []
            call = tool_output(self.tool_plan, "", "stop")[1][0]
            header = {"index": 0, **call, "function": {"name": call["function"]["name"], "arguments": ""}}
            out.append(
                self._chunk(
                    [{"index": k, "delta": {"tool_calls": [header]}, "logprobs": None, "finish_reason": None}]
                )
            )
        if msg.text or msg.logprobs:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": msg.text}}]}
            k_top = self.asked.logprobs
            lps = lp_mod.chat_logprobs(msg.logprobs, k_top) if k_top is not None else None
            out.append(self._chunk([{"index": k, "delta": delta, "logprobs": lps, "finish_reason": None}]))
        if msg.finish_reason:
            self.held_text.pop(k, None)
            out.append(
                self._chunk(
                    [
                        {
                            "index": k,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": finish_reason(msg.finish_reason),
                        }
                    ]
                )
            )
        return out

    def _tool_chunks(self, k: int, reason: str) -> list[dict[str, Any]]:
        """A held choice's content or tool calls, then its finish chunk."""
        message, reason = _message("".join(self.held_text.pop(k, [])), reason, self.tool_plan)
        lps = self.held_logprobs.pop(k, [])
        out = []
        if message["content"] or lps:
            out.append(
                self._chunk(
                    [
                        {
                            "index": k,
                            "delta": {"content": message["content"] or ""},
                            "logprobs": lp_mod.chat_logprobs(lps, self.asked.logprobs)
                            if self.asked.logprobs is not None
                            else None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        for i, call in enumerate(message.get("tool_calls", [])):
            delta = {"tool_calls": [{"index": i, **call}]}
            out.append(self._chunk([{"index": k, "delta": delta, "logprobs": None, "finish_reason": None}]))
        out.append(
            self._chunk([{"index": k, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)}])
        )
        return out

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(
            sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values())
        )
        return chunk
