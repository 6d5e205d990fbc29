"""GenerateResponse / GenerateStreamResponse -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

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


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def finish_reason(reason: str) -> str | None:
    return reason or None  # "stop" | "length" as OpenAI's; "abort" passes through


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(lps, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object for `lps` (TokenLogprob messages)."""
    tokens = [lp.token for lp in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": _token_bytes(lp.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)} for t in lp.top
                ],
            }
            for lp in lps
        ]
    }


def _usage_of(completions) -> dict[str, int]:
    # Each input's prompt counts once, however many samples it has (as OpenAI counts n).
    prompts = {c.index: c.prompt_tokens for c in completions}
    return usage(sum(prompts.values()), sum(c.completion_tokens for c in completions))


def completion_body(resp: pb.GenerateResponse, model: str, want_logprobs: bool) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": k,
                "text": c.text,
                "finish_reason": finish_reason(c.finish_reason),
                "logprobs": completion_logprobs(c.logprobs) if want_logprobs else None,
            }
            for k, c in enumerate(resp.completions)
        ],
        "usage": _usage_of(resp.completions),
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
    resp: pb.GenerateResponse, model: str, want_logprobs: bool, tool_plan: ToolPlan | None = None
) -> dict[str, Any]:
    choices = []
    for k, c in enumerate(resp.completions):
        message, reason = _message(c.text, c.finish_reason, tool_plan)
        choices.append(
            {
                "index": k,
                "message": message,
                "finish_reason": finish_reason(reason),
                "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
            }
        )
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage_of(resp.completions),
    }


class StreamState:
    """Builds the chunks of one streamed call: choice index = input * n + sample, as OpenAI numbers them."""

    def __init__(
        self, model: str, n: int, chat: bool, want_logprobs: bool, tool_plan: ToolPlan | None = None
    ):
        self.id = new_id("chatcmpl" if chat else "cmpl")
        # With tools (other than "none"): each choice's text is held until it ends (tools.py says why).
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.parses else None
        self.held_text: dict[int, list[str]] = {}
        self.held_logprobs: dict[int, list] = {}
        self.created = int(time.time())
        self.model, self.n, self.chat, self.want_logprobs = model, n, chat, want_logprobs
        self.started: set[int] = set()
        self.text_offset: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}
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
                lps = chat_logprobs(msg.logprobs) if self.want_logprobs else None
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
        offset = self.text_offset.get(k, 0)
        self.text_offset[k] = offset + len(msg.text)
        if msg.text or msg.logprobs or msg.finish_reason:
            lps = completion_logprobs(msg.logprobs, offset) if self.want_logprobs else None
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
            lps = chat_logprobs(msg.logprobs) if self.want_logprobs else None
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
                            "logprobs": chat_logprobs(lps) if self.want_logprobs else None,
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
        chunk["usage"] = usage(sum(self.prompt_tokens.values()), self.completion_tokens)
        return chunk
