"""GenerateStreamResponse messages -> OpenAI's stream chunks (server-sent events), built with the
same helpers as the non-streaming bodies in responses.py so that a stream's pieces add up to them."""

from __future__ import annotations

import time
from typing import Any

from loraplex.services.openai import logprobs as lp_mod
from loraplex.services.openai.responses import (
    Asked,
    assistant_message,
    echoed,
    finish_reason,
    generated,
    new_id,
    prompt_fields,
    usage,
)
from loraplex.services.openai.tool_parse import call as tool_call
from loraplex.services.openai.tools import ToolPlan
from loraplex.v1 import inference_pb2 as pb


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

    def _finish_chunk(self, k: int, reason: str) -> dict[str, Any]:
        """A chat choice's last chunk: an empty delta and why it ended."""
        return self._chunk(
            [{"index": k, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)}]
        )

    def chunks(self, msg: pb.GenerateStreamResponse) -> list[dict[str, Any]]:
        k = msg.index * self.n + msg.sample
        out = []
        if msg.finish_reason:
            self.prompt_tokens[msg.index] = msg.prompt_tokens
            self.cached_tokens[msg.index] = max(
                self.cached_tokens.get(msg.index, 0), msg.cached_prompt_tokens
            )
            # scoring only, the one generated token is dropped: none counted (as responses._usage_of)
            self.completion_tokens += 0 if self.asked.score_only else msg.completion_tokens
        # A sample's first message carries its prompt's log probabilities (the server sends them with
        # the first generated token): what the body has of the prompt leads that choice's stream.
        first = k not in self.started
        self.started.add(k)
        lead = prompt_fields(msg, self.asked) if first else {}
        if not self.chat:
            return self._completion_chunks(k, msg, first, lead)
        if first:  # the body's prompt_logprobs sits beside its choices: here beside the role delta
            role = {
                "index": k,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            out.append(self._chunk([role]) | lead)
        if self.tool_plan is not None and self.tool_plan.mode == "named" and not self.tool_plan.held:
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
            lps = (
                lp_mod.chat_logprobs(msg.logprobs, k_top, self.asked.token_ids) if k_top is not None else None
            )
            out.append(
                self._chunk(
                    [{"index": k, "delta": {"content": msg.text}, "logprobs": lps, "finish_reason": None}]
                )
            )
        if msg.finish_reason:
            out.append(self._finish_chunk(k, msg.finish_reason))
        return out

    def _completion_chunks(
        self, k: int, msg: pb.GenerateStreamResponse, first: bool, lead: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """With echo, a choice's first chunk is the prompt (and its tokens' log probabilities), as
        vLLM streams it; the generated text follows, its offsets counted on from the prompt's."""
        out = []
        offsets = self.text_offset.setdefault(k, lp_mod.TextOffsets())
        if first and self.asked.echo:
            prompt, lps = echoed(msg, self.asked, offsets)
            out.append(
                self._chunk([{"index": k, "text": prompt, "logprobs": lps, "finish_reason": None} | lead])
            )
            lead = {}
        text, generated_lps, reason = generated(msg, self.asked)
        if text or generated_lps or reason or lead:
            lps = None
            if self.asked.logprobs is not None:
                lps = lp_mod.legacy(generated_lps, offsets, self.asked.logprobs, ids=self.asked.token_ids)
            choice = {"index": k, "text": text, "logprobs": lps, "finish_reason": finish_reason(reason)}
            out.append(self._chunk([choice | lead]))
        return out

    def _named_call_chunks(self, k: int, msg: pb.GenerateStreamResponse) -> list[dict[str, Any]]:
        """A forced function streams as OpenAI streams a call: its id and name first, then the
        arguments as they are generated (the output is the arguments)."""
        out = []
        if k not in self.held_text:  # first message of this choice: the call's header
            self.held_text[k] = []
            call = tool_call(self.tool_plan.name, "")
            header = {"index": 0, **call, "function": {"name": call["function"]["name"], "arguments": ""}}
            out.append(
                self._chunk(
                    [{"index": k, "delta": {"tool_calls": [header]}, "logprobs": None, "finish_reason": None}]
                )
            )
        if msg.text or msg.logprobs:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": msg.text}}]}
            k_top = self.asked.logprobs
            lps = (
                lp_mod.chat_logprobs(msg.logprobs, k_top, self.asked.token_ids) if k_top is not None else None
            )
            out.append(self._chunk([{"index": k, "delta": delta, "logprobs": lps, "finish_reason": None}]))
        if msg.finish_reason:
            self.held_text.pop(k, None)
            out.append(self._finish_chunk(k, msg.finish_reason))
        return out

    def _tool_chunks(self, k: int, reason: str) -> list[dict[str, Any]]:
        """A held choice's content or tool calls, then its finish chunk."""
        message, reason = assistant_message("".join(self.held_text.pop(k, [])), reason, self.tool_plan)
        lps = self.held_logprobs.pop(k, [])
        out = []
        if message["content"] or lps:
            out.append(
                self._chunk(
                    [
                        {
                            "index": k,
                            "delta": {"content": message["content"] or ""},
                            "logprobs": lp_mod.chat_logprobs(lps, self.asked.logprobs, self.asked.token_ids)
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
        out.append(self._finish_chunk(k, reason))
        return out

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(
            sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values())
        )
        return chunk
