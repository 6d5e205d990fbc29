"""OpenAI's deprecated `functions` / `function_call` as tools, and the answer back in their shape.

A request with `functions` is rewritten before it is parsed: each function becomes a tool,
`function_call` the `tool_choice` ("none" / "auto" / {"name"} -> a named function), an assistant
message's `function_call` one tool call and a `function` message a tool message answering it. The
answer then carries `message.function_call` (the first call; `functions` calls one at a time)
instead of `tool_calls`, and finish_reason "function_call" for "tool_calls", as OpenAI answers
this form; a stream's deltas the same.
"""

from __future__ import annotations

from typing import Any

from loraplex.services.openai.errors import bad_request


def _call_id(name: str, i: int) -> str:
    return f"call_{i}_{name}"[:64]


def rewrite(body: dict[str, Any]) -> bool:
    """Rewrite `body` (in place) when it uses `functions` / `function_call`; True when it did."""
    functions = body.pop("functions", None)
    choice = body.pop("function_call", None)
    messages = body.get("messages")
    legacy_messages = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call")) for m in messages
    )
    if not functions and choice is None and not legacy_messages:
        return False
    if functions and body.get("tools"):
        raise bad_request(
            "give tools or functions, not both (functions is their deprecated form)", "functions"
        )
    if functions is not None:
        if not isinstance(functions, list):
            raise bad_request("functions must be a list of function definitions", "functions")
        if functions:
            body["tools"] = [{"type": "function", "function": f} for f in functions]
    if choice is not None:
        if body.get("tool_choice") is not None:
            raise bad_request("give tool_choice or function_call, not both", "function_call")
        if choice in ("none", "auto"):
            body["tool_choice"] = choice
        elif isinstance(choice, dict) and isinstance(choice.get("name"), str) and set(choice) == {"name"}:
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise bad_request('function_call must be "none", "auto" or {"name": ...}', "function_call")
    if legacy_messages:
        body["messages"] = _messages(messages)
    return bool(functions) or choice is not None


def _messages(messages: list[Any]) -> list[Any]:
    """Assistant `function_call`s as tool calls, `function` messages as the tool messages answering them."""
    out, last_id = [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        call = m.pop("function_call", None)
        if call is not None:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise bad_request(
                    f"messages[{i}].function_call must be {{name, arguments}}", f"messages[{i}].function_call"
                )
            last_id[call["name"]] = _call_id(call["name"], i)
            m["tool_calls"] = [
                {
                    "id": last_id[call["name"]],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call.get("arguments", "{}")},
                }
            ]
        if m.get("role") == "function":
            name = m.get("name")
            if not isinstance(name, str) or name not in last_id:
                raise bad_request(
                    f"messages[{i}] (role function) must name a function an earlier assistant message called",
                    f"messages[{i}].name",
                )
            m["role"], m["tool_call_id"] = "tool", last_id[name]
        out.append(m)
    return out


def _function_call(calls: list[dict[str, Any]]) -> dict[str, str]:
    return {"name": calls[0]["function"]["name"], "arguments": calls[0]["function"]["arguments"]}


def answer(body: dict[str, Any]) -> None:
    """A chat completion body's choices in the `functions` shape (in place)."""
    for choice in body.get("choices", []):
        message = choice.get("message", {})
        calls = message.pop("tool_calls", None)
        if calls:
            message["function_call"] = _function_call(calls)
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "function_call"


def chunk(chunk: dict[str, Any]) -> None:
    """A stream chunk's choices in the `functions` shape (in place): a tool-call delta becomes a
    function_call delta (name with its first piece, then the arguments as they come)."""
    for choice in chunk.get("choices", []):
        delta = choice.get("delta", {})
        calls = delta.pop("tool_calls", None)
        if calls:
            fn = calls[0].get("function", {})
            delta["function_call"] = {k: v for k, v in fn.items() if k in ("name", "arguments")}
        if choice.get("finish_reason") == "tool_calls":
            choice["finish_reason"] = "function_call"
