"""Tool calls at the chat door: `tools` + `tool_choice` -> the request, the output -> `tool_calls`.

- The tools travel as `Input.tools_json` and are rendered by the server through the chat template
  (engine/chat_tools.py); earlier assistant tool calls and `tool` messages travel in ChatMessage,
  their shape checked here first (tool_history.py). Tool names follow OpenAI's rule
  (`^[a-zA-Z0-9_-]{1,64}$`), each once.
- `tool_choice: "none"`: the tools are shown, the output is plain content.
- `"auto"` (the default with tools): free decoding; the output is parsed (tool_parse.py) from the
  model's own tool-call format: Hermes / Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks,
  or a Llama 3.1 JSON call (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`,
  several separated by ";"). Only calls to functions in `tools` count: a call to any other name stays
  in the content. Calls found -> `tool_calls`, finish_reason "tool_calls" (or "length" when cut
  short after them); else content.
- `"required"`: decoded under a JSON schema `{"name": one of the tools, "arguments": its parameters}`,
  so the output is one valid call (finish_reason "tool_calls").
- a named function: decoded under that function's parameters schema; the output is its arguments
  (finish_reason "stop", as OpenAI answers a forced function).

Cut short, as OpenAI answers: a forced ("required" / named) call cut by max_tokens comes back in
`tool_calls` with its partial arguments and finish_reason "length". One cut by a `stop` string or
stop token (its arguments are not valid JSON) is no call: the text comes back as content with
finish_reason "stop", so arguments that are not whole are never returned under a finish reason that
says the call is done.

Streaming: a named function streams as OpenAI streams a call (a delta with its id and name, then
the arguments as they are generated), unless the request has stop strings or stop tokens: then, as
with "auto" and "required", the content or the calls are sent whole when the output ends (one delta
per call, arguments complete), since a call cannot be told from content (or its name read, or a cut
seen) before then.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from loraplex.services.inference.engine.chat_tools import MAX_TOOLS, TOOL_NAME_RULE
from loraplex.services.openai import tool_history, tool_parse
from loraplex.services.openai.errors import bad_request
from loraplex.v1 import inference_pb2 as pb


class ToolPlan(NamedTuple):
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]
    name: str | None = None  # the function of mode "named"
    # a named call's stream is held to its end (stop strings or tokens could cut its arguments)
    held: bool = False

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


def _check_tool(i: int, tool: Any, seen: set[str]) -> None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools[{i}]")
    name = fn.get("name")
    where = f"tools[{i}].function.name"
    if not isinstance(name, str) or not TOOL_NAME_RULE.fullmatch(name):
        got = f"{name[:80]!r}" if isinstance(name, str) else f"a {type(name).__name__}"
        raise bad_request(
            f"{where} must be 1 to 64 letters, digits, underscores or dashes (got {got})", where
        )
    if name in seen:
        raise bad_request(f"{where} {name!r} is given twice; each tool needs its own name", where)
    seen.add(name)
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        where = f"tools[{i}].function.parameters"
        raise bad_request(f"{where} must be a JSON schema (an object)", where)


def plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """Check `tools` and `tool_choice`; None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} entries; at most {MAX_TOOLS}", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        _check_tool(i, tool, names)
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
        raise bad_request(f"tool_choice names {fn['name'][:80]!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", tools, fn["name"])


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constrain(tool_plan: ToolPlan, params: pb.SamplingParams) -> dict[str, str]:
    """Set the constraint of "required" / named; returns {gRPC field: door field} for errors."""
    if tool_plan.mode == "named":
        i = next(i for i, t in enumerate(tool_plan.tools) if t["function"]["name"] == tool_plan.name)
        params.json_schema = json.dumps(_parameters(tool_plan.tools[i]))
        return {"sampling_params.json_schema": f"tools[{i}].function.parameters"}
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


def parse_auto(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a free output in Hermes/Qwen or Llama 3.1 form; no calls -> (text, [])."""
    rest, calls = tool_parse.hermes_calls(text, names)
    if calls:
        return rest.strip() or None, calls
    calls = tool_parse.json_calls(text, names)
    return (None, calls) if calls else (text, [])


def tool_output(tool_plan: ToolPlan, text: str, finish_reason: str) -> tuple[str | None, list, str]:
    """(content, tool_calls, finish_reason) of one choice's whole output."""
    if tool_plan.mode == "none" or finish_reason not in ("stop", "length"):
        return text, [], finish_reason  # e.g. "abort": the text as it is
    names = tool_plan.names
    if tool_plan.mode == "named":
        if finish_reason == "length":  # OpenAI: the partial arguments, and "length" says they are
            return None, [tool_parse.call(tool_plan.name, text)], "length"
        if isinstance(tool_parse.loads(text), dict):
            return None, [tool_parse.call(tool_plan.name, text)], "stop"
        return text, [], "stop"  # a stop string or token cut the arguments: no call
    if tool_plan.mode == "required":
        obj = tool_parse.loads(text) if finish_reason == "stop" else None
        if isinstance(obj, dict) and obj.get("name") in names and "arguments" in obj:
            return None, [tool_parse.call(obj["name"], obj["arguments"])], "tool_calls"
        head = tool_parse.required_head(text, names) if finish_reason == "length" else None
        if head is not None:
            return None, [tool_parse.call(*head)], "length"
        return text, [], finish_reason
    content, calls = parse_auto(text, names)
    return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason


def chat_messages(messages) -> list[pb.ChatMessage]:
    """The request's messages with their tool fields (content parts joined, None content = ""),
    each history's tool fields checked first (a 400 naming the field, never a 500 downstream)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        extra = m.model_extra or {}
        tool_history.check(i, m.role, extra)
        msg = pb.ChatMessage(role=m.role, content=content)
        if extra.get("tool_calls"):
            msg.tool_calls_json = json.dumps(extra["tool_calls"])
        if extra.get("tool_call_id") is not None:
            msg.tool_call_id = extra["tool_call_id"]
        if extra.get("name") is not None:
            msg.name = extra["name"]
        out.append(msg)
    return out
