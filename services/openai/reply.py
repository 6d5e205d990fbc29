"""The last touches on an answer that come from the request rather than from the output
(extensions.ReplyOptions): vLLM's `request_id` as the answer's id, `service_tier` answered
"default", the `functions` shape, chat `echo`, and on streams `continuous_usage_stats` and
`include_obfuscation`. Bodies and chunks are built first (responses.py, stream.py), then finished here.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

from loraplex.services.openai import legacy_functions
from loraplex.services.openai.extensions import ReplyOptions
from loraplex.services.openai.responses import usage
from loraplex.v1 import inference_pb2 as pb

_PAD = string.ascii_letters + string.digits


def answer_id(prefix: str, options: ReplyOptions, generated: str) -> str:
    return f"{prefix}-{options.request_id}" if options.request_id else generated


def _prefix(body: dict[str, Any]) -> str:
    return "chatcmpl" if body.get("object", "").startswith("chat.") else "cmpl"


def finish_body(body: dict[str, Any], options: ReplyOptions) -> dict[str, Any]:
    body["id"] = answer_id(_prefix(body), options, body["id"])
    if options.service_tier:
        body["service_tier"] = options.service_tier
    if options.echo:
        for choice in body["choices"]:
            message = choice["message"]
            message["content"] = options.echo + (message.get("content") or "")
    if options.legacy_functions:
        legacy_functions.answer(body)
    return body


class StreamReply:
    """Finishes a stream's chunks; `observe` each gRPC message before its chunks are finished."""

    def __init__(self, options: ReplyOptions, score_only: bool = False):
        self.options = options
        self.score_only = score_only
        self.prompt_tokens: dict[int, int] = {}  # per input, as the server counted so far
        self.completion_tokens: dict[tuple[int, int], int] = {}  # per (input, sample)
        self.id: str | None = None

    def observe(self, msg: pb.GenerateStreamResponse) -> None:
        self.prompt_tokens[msg.index] = msg.prompt_tokens
        self.completion_tokens[(msg.index, msg.sample)] = 0 if self.score_only else msg.completion_tokens

    def running_usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))

    def finish(self, chunk: dict[str, Any]) -> dict[str, Any]:
        options = self.options
        if self.id is None:
            self.id = answer_id(_prefix(chunk), options, chunk["id"])
        chunk["id"] = self.id
        if options.service_tier:
            chunk["service_tier"] = options.service_tier
        if options.echo:
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                if "role" in delta:  # the role chunk leads each choice: the echoed text goes there
                    delta["content"] = options.echo + (delta.get("content") or "")
        if options.legacy_functions:
            legacy_functions.chunk(chunk)
        if options.continuous_usage and chunk["choices"] and "usage" not in chunk:
            chunk["usage"] = self.running_usage()
        if options.obfuscation and chunk["choices"]:
            chunk["obfuscation"] = padding()
        return chunk


def padding() -> str:
    """OpenAI's `obfuscation`: random characters of random length, so sizes tell nothing of the text."""
    return "".join(secrets.choice(_PAD) for _ in range(secrets.randbelow(16) + 1))
