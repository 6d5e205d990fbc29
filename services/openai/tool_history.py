"""The tool fields of a chat history, checked at the door: an assistant message's `tool_calls` and a
message's `tool_call_id` / `name`. Each wrong shape is a 400 naming the field
(`messages[2].tool_calls[0].function`) rather than an error deeper in (the server's JSON reading or
the chat template), which would come back as a 500 or name no field.

A call is `{"id"?: str, "type"?: "function", "function": {"name": str, "arguments": str | object}}`:
OpenAI's shape, where `arguments` is JSON text; an object is accepted too (chat templates read
objects). Its name follows the rule of tool names (it is written into the prompt).
"""

from __future__ import annotations

from typing import Any

from loraplex.services.inference.engine.chat_tools import TOOL_NAME_RULE
from loraplex.services.openai.errors import bad_request

CALL_SHAPE = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}'


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _check_call(where: str, call: Any) -> None:
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be a tool call {CALL_SHAPE} (got {_kind(call)})", where)
    if "id" in call and not isinstance(call["id"], str):
        raise bad_request(f"{where}.id must be a string (got {_kind(call['id'])})", f"{where}.id")
    if call.get("type", "function") != "function":
        raise bad_request(f'{where}.type must be "function"', f"{where}.type")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad_request(
            f'{where}.function must be an object {{"name": ..., "arguments": ...}} (got {_kind(fn)})',
            f"{where}.function",
        )
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RULE.fullmatch(name):
        got = f"{name[:80]!r}" if isinstance(name, str) else _kind(name)
        raise bad_request(
            f"{where}.function.name must be a tool name: 1 to 64 letters, digits, underscores or "
            f"dashes (got {got})",
            f"{where}.function.name",
        )
    args = fn.get("arguments")
    if not isinstance(args, str | dict):
        raise bad_request(
            f"{where}.function.arguments must be the arguments as JSON text (got {_kind(args)})",
            f"{where}.function.arguments",
        )


def check(i: int, role: str, extra: dict[str, Any]) -> None:
    """Message `i`'s tool fields (`extra`: its fields beyond role and content)."""
    calls = extra.get("tool_calls")
    where = f"messages[{i}].tool_calls"
    if calls is not None and calls != []:
        if role != "assistant":
            raise bad_request(f"{where}: only an assistant message makes tool calls (this is {role})", where)
        if not isinstance(calls, list):
            raise bad_request(f"{where} must be a list of tool calls (got {_kind(calls)})", where)
        for k, call in enumerate(calls):
            _check_call(f"{where}[{k}]", call)
    for key in ("tool_call_id", "name"):
        value = extra.get(key)
        if value is not None and not isinstance(value, str):
            where = f"messages[{i}].{key}"
            raise bad_request(f"{where} must be a string (got {_kind(value)})", where)
