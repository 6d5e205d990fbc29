"""GenerateResponse / GenerateStreamResponse -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import time
import uuid
from typing import Any, NamedTuple

from loraplex.services.openai import logprobs as lp_mod
from loraplex.v1 import inference_pb2 as pb


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


def chat_body(resp: pb.GenerateResponse, model: str, asked: Asked) -> dict[str, Any]:
    body = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": k,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": finish_reason(c.finish_reason),
                "logprobs": lp_mod.chat_logprobs(c.logprobs, asked.logprobs)
                if asked.logprobs is not None
                else None,
            }
            for k, c in enumerate(resp.completions)
        ],
        "usage": _usage_of(resp.completions),
    }
    if asked.prompt_logprobs is not None and resp.completions:  # vLLM: one list for the one prompt
        body["prompt_logprobs"] = lp_mod.prompt_logprobs(
            resp.completions[0].prompt_logprobs, asked.prompt_logprobs
        )
    return body


class StreamState:
    """Builds the chunks of one streamed call: choice index = input * n + sample, as OpenAI numbers them."""

    def __init__(self, model: str, n: int, chat: bool, asked: Asked):
        self.id = new_id("chatcmpl" if chat else "cmpl")
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

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(
            sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values())
        )
        return chunk
