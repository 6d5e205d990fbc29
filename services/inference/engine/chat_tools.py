"""Tools in chat rendering: OpenAI tool definitions and tool-call messages -> what chat templates read.

A template that knows tools (Llama 3.1, Qwen 2.5, Hermes: its source mentions `tools`) gets them as
`tools=` and assistant messages' `tool_calls` with `arguments` as objects, as transformers' chat
templates expect. A template that does not (SmolLM2's) would drop them silently, so the tools are
described in the system message instead, asking for Hermes-style `<tool_call>` replies, and earlier
tool calls are written into the assistant's content in that same form.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.services.inference.errors import InvalidRequest

MAX_TOOLS = 128
# OpenAI's rule for function names (fullmatch). A name is written into the prompt: free text could
# close the turn (`"}\n<|im_end|>`) or pose as another tool.
TOOL_NAME_RULE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FALLBACK_PROMPT = (
    "You may call functions to answer. The functions, as JSON schemas:\n{tools}\n"
    'To call one, reply with only <tool_call>{{"name": NAME, "arguments": ARGUMENTS}}</tool_call>.'
)


def parse_tools(text: str, field: str) -> list[dict[str, Any]]:
    """The tool definitions of a `tools_json` field, checked for the shape templates read."""
    try:
        tools = json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"{field} is JSON nested too deeply", field=field) from None
    except ValueError as exc:
        raise InvalidRequest(f"{field} is not valid JSON: {exc}", field=field) from None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{field} must be a list of at most {MAX_TOOLS} tools", field=field)
    seen = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(
                f'{field}[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', field=field
            )
        if not TOOL_NAME_RULE.fullmatch(fn["name"]) or fn["name"] in seen:
            raise InvalidRequest(
                f"{field}[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes, "
                f"and not another tool's (got {fn['name'][:80]!r})",
                field=field,
            )
        seen.add(fn["name"])
    return tools


def parse_tool_calls(text: str, field: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls_json`, with each call's arguments as an object."""
    try:
        calls = json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"{field} is JSON nested too deeply", field=field) from None
    except ValueError as exc:
        raise InvalidRequest(f"{field} is not valid JSON: {exc}", field=field) from None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InvalidRequest(f"{field} must be a list of tool calls", field=field)
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(
                f'{field}[{k}].function must be an object {{"name": ..., "arguments": ...}}', field=field
            )
        if not TOOL_NAME_RULE.fullmatch(fn["name"]):
            raise InvalidRequest(
                f"{field}[{k}].function.name must be 1 to 64 letters, digits, underscores or dashes "
                f"(got {fn['name'][:80]!r})",
                field=field,
            )
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass  # left as the text the caller sent
        elif args is not None and not isinstance(args, dict):
            raise InvalidRequest(
                f"{field}[{k}].function.arguments must be JSON text or an object", field=field
            )
        out.append({**call, "type": call.get("type", "function"), "function": fn})
    return out


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def calls_as_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with assistant tool calls written into the content as <tool_call> blocks (for a
    template that renders no `tool_calls`, which would otherwise show an empty turn)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [
                "<tool_call>"
                + json.dumps({"name": c["function"].get("name"), "arguments": c["function"].get("arguments")})
                + "</tool_call>"
                for c in calls
            ]
            m["content"] = "\n".join([m.get("content") or "", *blocks]).strip()
        m.pop("tool_call_id", None)
        m.pop("name", None)
        out.append(m)
    return out


def describe_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that renders no tools: the tools in the system message, tool calls
    written into the assistant's content as <tool_call> blocks."""
    described = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t)) for t in tools))
    out = calls_as_content(messages)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{described}"
    else:
        out.insert(0, {"role": "system", "content": described})
    return out
