"""The Response object of the Responses API (responses_api.py reads the request): its fields from
the request, its output items (a `message` with one `output_text` part, a `function_call` per tool
call), usage as input / output tokens, and `status` "incomplete" (reason `max_output_tokens`) when
the output was cut. The non-streaming answer is built here; streams (responses_api_stream.py)
build the same object piece by piece."""

from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def text_logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((chat_logprobs or {}).get("content") or [])


def message_item(text: str, logprobs: list, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}],
    }


def call_item(call: dict[str, Any], item_id: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def shell(body: dict[str, Any], model: str, response_id: str, created: int | None = None) -> dict[str, Any]:
    """The Response object's fields that come from the request (status and output filled later)."""
    text = body.get("text") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created or int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": body.get("temperature", 1.0),
        "text": {
            "format": text.get("format") or {"type": "text"},
            "verbosity": text.get("verbosity", "medium"),
        },
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs", 0),
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def finish(response: dict[str, Any], finish_reason: str | None, chat_usage: dict[str, Any] | None) -> None:
    """Status, incomplete details and usage, once the output is known (in place)."""
    cut = finish_reason == "length"
    response["status"] = "incomplete" if cut else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    if chat_usage is not None:
        response["usage"] = usage(chat_usage)


def response_object(body: dict[str, Any], model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (n = 1) as the Response object."""
    response = shell(body, model, new_id("resp"))
    choice = chat["choices"][0]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    if message.get("content") or not message.get("tool_calls"):
        response["output"].append(
            message_item(
                message.get("content") or "", text_logprobs(choice.get("logprobs")), new_id("msg"), status
            )
        )
    for call in message.get("tool_calls") or []:
        response["output"].append(call_item(call, new_id("fc"), status))
    finish(response, choice["finish_reason"], chat["usage"])
    return response
