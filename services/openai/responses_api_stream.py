"""A Responses API stream: the chat stream's chunks (stream.py) re-told as OpenAI's Responses
events, each a server-sent event named by its `type` and numbered by `sequence_number`:

response.created, response.in_progress; for text: response.output_item.added (a message),
response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done; for each tool call:
response.output_item.added (a function_call), response.function_call_arguments.delta ...,
response.function_call_arguments.done, response.output_item.done; then response.completed (or
response.incomplete when max_output_tokens cut the output), with usage. An error after the
stream started is a `error` event.
"""

from __future__ import annotations

import copy
from typing import Any

from loraplex.services.openai import responses_api_output as api
from loraplex.services.openai.reply import padding


class ResponseEvents:
    def __init__(self, body: dict[str, Any], model: str, obfuscation: bool = False):
        self.response = api.shell(body, model, api.new_id("resp"))
        self.obfuscation = obfuscation  # stream_options.include_obfuscation: padding on delta events
        self.seq = 0
        self.message: dict[str, Any] | None = None  # the open message item
        self.message_index = -1
        self.calls: dict[int, tuple[int, dict[str, Any]]] = {}  # chat tool-call index -> (output index, item)
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        if self.obfuscation and kind.endswith(".delta"):
            event["obfuscation"] = padding()
        return event

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = api.message_item("", [], api.new_id("msg"), "in_progress")
        self.message_index = len(self.response["output"])
        self.response["output"].append(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event(
                "response.output_item.added",
                output_index=self.message_index,
                item={**self.message, "content": []},
            ),
            self._event(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=self.message_index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        message, index = self.message, self.message_index
        self.message = None
        part = message["content"][0]
        message["status"] = status
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", **ids, part=part),
            self._event("response.output_item.done", output_index=index, item=message),
        ]

    def _text(self, delta: str, logprobs: list) -> list[dict[str, Any]]:
        out = [] if self.message is not None else self._open_message()
        part = self.message["content"][0]
        part["text"] += delta
        part["logprobs"].extend(logprobs)
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.message_index,
                content_index=0,
                delta=delta,
                logprobs=logprobs,
            )
        )
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        fn = call.get("function", {})
        if call["index"] not in self.calls:  # its first delta: id and name
            out += self._close_message("completed")
            item = api.call_item(
                {"id": call["id"], "function": {"name": fn["name"], "arguments": ""}},
                api.new_id("fc"),
                "in_progress",
            )
            self.calls[call["index"]] = (len(self.response["output"]), item)
            self.response["output"].append(item)
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.response["output"]) - 1,
                    item=dict(item),
                )
            )
        index, item = self.calls[call["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=fn["arguments"],
                )
            )
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (n = 1); the usage chunk ends the stream."""
        if "usage" in chunk and not chunk["choices"]:
            return self.end(chunk["usage"])
        out = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            logprobs = api.text_logprobs(choice.get("logprobs"))
            if delta.get("content") or (logprobs and not delta.get("tool_calls")):
                out += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or []:
                out += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def end(self, chat_usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if not self.response["output"]:
            out = self._open_message()  # an empty answer is still one (empty) message, as the body has
        else:
            out = []
        out += self._close_message(status)
        for index, item in sorted(self.calls.values(), key=lambda c: c[0]):
            item["status"] = status
            ids = {"item_id": item["id"], "output_index": index}
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        api.finish(self.response, self.finish_reason, chat_usage)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self._snapshot()))
        return out

    def error(self, err) -> dict[str, Any]:
        return self._event("error", code=err.code, message=err.message, param=err.param)
