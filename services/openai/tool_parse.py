"""Reading tool calls out of a model's text, in time linear in the text (tools.py decides what to
read when).

Every scan here moves forward only: `str.find` for the Hermes / Qwen tags, `JSONDecoder.raw_decode`
for JSON, and anchored patterns whose pieces cannot overlap (so they never backtrack). A regex such as
`<tool_call>\\s*(.*?)\\s*</tool_call>` tries every split of a run of spaces between its three parts:
cubic in the run, 90 s for `<tool_call>` and 6,000 spaces, with the GIL held.

A parsed call counts only when it names one of the request's tools (`names`): a call to a function
the caller did not offer stays text (issue 55).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WS = re.compile(r"\s*")
# The start of a "required" output, `{"name": "...", "arguments": `, as its JSON schema orders it;
# the pieces are separated by characters \s never matches, so the match is one forward pass.
_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` as text (kept as generated) or an object (serialized)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def loads(text: str) -> Any:
    """json.loads, None for anything that is not JSON (too deep counts as not JSON: the C decoder
    raises RecursionError, which is no ValueError)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_of(obj: Any, names: frozenset[str]) -> dict[str, Any] | None:
    """`{"name", "arguments" | "parameters"}` naming one of `names` -> a call; anything else None."""
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in names:
        args = obj.get("arguments", obj.get("parameters"))
        if args is None or isinstance(args, dict | str):
            return call(obj["name"], args)
    return None


def hermes_calls(text: str, names: frozenset[str]) -> tuple[str, list[dict[str, Any]]]:
    """The `<tool_call>{...}</tool_call>` blocks of `text` that are calls, and the text without them
    (a block that is no call, or an unclosed one, stays in the text)."""
    calls, kept, pos, search = [], [], 0, 0
    while (start := text.find(OPEN, search)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break  # no block closes after here: nothing further to find
        found = _call_of(loads(text[start + len(OPEN) : end]), names)
        search = end + len(CLOSE)
        if found is not None:
            calls.append(found)
            kept.append(text[pos:start])
            pos = search
    kept.append(text[pos:])
    return "".join(kept), calls


def json_calls(text: str, names: frozenset[str]) -> list[dict[str, Any]]:
    """Llama 3.1's form: the whole text is JSON calls (after an optional `<|python_tag|>`), separated
    by ";". [] unless all of it is."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return []
    calls, pos = [], 0
    while True:
        try:
            obj, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return []
        found = _call_of(obj, names)
        if found is None:
            return []
        calls.append(found)
        pos = _WS.match(body, pos).end()
        if pos == len(body):
            return calls
        if body[pos] != ";":
            return []
        pos = _WS.match(body, pos + 1).end()
        if pos == len(body):
            return calls  # a trailing ";"


def required_head(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, the arguments' text so far) of a "required" output that was cut, when its name is whole."""
    m = _REQUIRED_HEAD.match(text)
    name = loads(m.group(1)) if m else None
    return (name, text[m.end() :]) if isinstance(name, str) and name in names else None
