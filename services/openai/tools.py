"""Tool calls at the chat door: `tools` + `tool_choice` -> the request, the output -> `tool_calls`.

- The tools travel as `Input.tools_json` and are rendered by the server through the chat template
  (engine/chat_tools.py); earlier assistant tool calls and `tool` messages travel in ChatMessage.
- `tool_choice: "none"`: the tools are shown, the output is plain content.
- `"auto"` (the default with tools): free decoding; the output is parsed from the model's own
  tool-call format: Hermes / Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks, or a
  Llama 3.1 JSON call (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several
  separated by ";"). Calls found -> `tool_calls`, finish_reason "tool_calls"; else content.
- `"required"`: decoded under a JSON schema `{"name": one of the tools, "arguments": its parameters}`,
  so the output is always one valid call (finish_reason "tool_calls").
- a named function: decoded under that function's parameters schema; the output is its arguments
  (finish_reason "stop", as OpenAI answers a forced function).

Streaming: a named function streams as OpenAI streams a call (a delta with its id and name, then
the arguments as they are generated); with "auto" and "required" the content or the calls are sent
whole when the output ends (one delta per call, arguments complete), since a call cannot be told
from content (or its name read) before then.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from loraplex.services.openai.errors import bad_request
from loraplex.v1 import inference_pb2 as pb

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


class ToolPlan(NamedTuple):
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]
    name: str | None = None  # the function of mode "named"

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Check `tools` and `tool_choice`; None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"tools[{i}].function.name must be a non-empty string", f"tools.{i}.function.name"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", f"tools.{i}")
        names.append(fn["name"])
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", tools)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, tools)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", tools, fn["name"])


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constrain(tool_plan: ToolPlan, params: pb.SamplingParams) -> dict[str, str]:
    """Set the constraint of "required" / named; returns {gRPC field: door field} for errors."""
    if tool_plan.mode == "named":
        tool = next(t for t in tool_plan.tools if t["function"]["name"] == tool_plan.name)
        params.json_schema = json.dumps(_parameters(tool))
        return {"sampling_params.json_schema": "tools.function.parameters"}
    if tool_plan.mode == "required":
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tool_plan.tools
        ]
        params.json_schema = json.dumps(one_of[0] if len(one_of) == 1 else {"anyOf": one_of})
        return {"sampling_params.json_schema": "tools.function.parameters"}
    return {}


def tools_json(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _json_call(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters"))
        if args is None or isinstance(args, dict | str):
            return _call(obj["name"], args)
    return None


def parse_auto(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a free output in Hermes/Qwen or Llama 3.1 form; no calls -> (text, [])."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = _json_call(json.loads(block))
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if calls:
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if body.startswith("{"):
        for piece in [body] if ";" not in body else [p.strip() for p in body.split(";") if p.strip()]:
            try:
                call = _json_call(json.loads(piece))
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return None, calls
    return text, []


def tool_output(tool_plan: ToolPlan, text: str, finish_reason: str) -> tuple[str | None, list, str]:
    """(content, tool_calls, finish_reason) of one choice's whole output."""
    if finish_reason != "stop" or tool_plan.mode == "none":
        return text, [], finish_reason  # cut short ("length"): the text as it is, no partial call
    if tool_plan.mode == "named":
        return None, [_call(tool_plan.name, text)], "stop"
    if tool_plan.mode == "required":
        try:  # the schema guarantees {"name", "arguments"} unless a stop string cut the output
            obj = json.loads(text)
            return None, [_call(obj["name"], obj["arguments"])], "tool_calls"
        except (ValueError, KeyError, TypeError):
            return text, [], finish_reason
    content, calls = parse_auto(text)
    return content, calls, "tool_calls" if calls else finish_reason


def chat_messages(messages) -> list[pb.ChatMessage]:
    """The request's messages with their tool fields (content parts joined, None content = "")."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        extra = m.model_extra or {}
        msg = pb.ChatMessage(role=m.role, content=content)
        if extra.get("tool_calls"):
            msg.tool_calls_json = json.dumps(extra["tool_calls"])
        if isinstance(extra.get("tool_call_id"), str):
            msg.tool_call_id = extra["tool_call_id"]
        if isinstance(extra.get("name"), str):
            msg.name = extra["name"]
        out.append(msg)
    return out
