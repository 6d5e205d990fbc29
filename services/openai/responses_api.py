"""OpenAI's Responses API (`POST /v1/responses`), stateless, as a chat call underneath.

A Responses body is read into a chat completions body (`chat_body`): `instructions` as the first
(system) message, `input` (a string, or items: messages with `input_text` / `output_text` parts,
`function_call` and `function_call_output`) as the messages, function `tools` and `tool_choice` in
the chat shape, `text.format` as `response_format`, `text.verbosity` and `reasoning.effort` as the
chat template's variables, `max_output_tokens` as `max_tokens`. That body then takes the chat path
(chat_schema.py: one parser, one set of checks), and the chat answer is written back as a Response
object (responses_api_output.py): a `message` item with one `output_text` part, one `function_call` item
per tool call, usage as input / output tokens, `status` "incomplete" (reason `max_output_tokens`)
when the output was cut. Streams are responses_api_stream.py.

Stateless: `previous_response_id`, `conversation` and `store: true` are refused (nothing is kept
to continue from or to retrieve); send the whole conversation as `input` items instead.
"""

from __future__ import annotations

from typing import Any

from loraplex.services.openai.errors import OpenAIError, bad_request

# Responses fields -> what happens to them. Anything else is an unknown field (400).
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier")
PASSED += ("prompt_cache_key", "prompt_cache_retention", "service_tier", "metadata", "stream", "top_logprobs")
READ = (
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "store",
    "previous_response_id",
    "conversation",
    "truncation",
    "include",
    "stream_options",
    "background",
    "max_tool_calls",
)
STATELESS = "this server keeps no responses (it is stateless): send the whole conversation as `input` items"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat fields a chat-path error may name -> the Responses field the caller wrote.
CHAT_TO_RESPONSES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "verbosity": "text.verbosity",
    "top_logprobs": "top_logprobs",
}


def _known(obj: Any, names: tuple[str, ...], where: str) -> dict:
    if not isinstance(obj, dict):
        raise bad_request(f"{where} must be an object", where)
    for key in obj:
        if key not in names:
            raise bad_request(
                f"unknown field {where}.{key[:100]} (known: {', '.join(names)})", f"{where}.{key[:100]}"
            )
    return obj


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            _known(part, ("type", "text", "annotations", "logprobs"), here)
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{here}.text must be a string", f"{here}.text")
            out.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{here} is {kind}: this server reads text only", here)
        else:
            raise bad_request(f"{here}.type must be input_text or output_text (got {kind!r})", here)
    return "".join(out)


def messages(input_: Any, instructions: Any) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages (tool calls and their outputs included)."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(input_, str):
        return [*out, {"role": "user", "content": input_}]
    if not isinstance(input_, list) or not input_:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    names: dict[str, str] = {}
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            _known(item, ("type", "role", "content", "id", "status"), where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role must be user, system, developer or assistant", f"{where}.role"
                )
            out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            _known(item, ("type", "call_id", "name", "arguments", "id", "status"), where)
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _known(item, ("type", "call_id", "output", "id", "status"), where)
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            message = {
                "role": "tool",
                "tool_call_id": item["call_id"],
                "content": _text_of(item.get("output"), f"{where}.output"),
            }
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            out.append(message)
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not available here (message, function_call, function_call_output)",
                f"{where}.type",
            )
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}] is {kind!r}: only function tools are available here (no hosted tools)",
                f"tools[{i}]",
            )
        _known(tool, ("type", "name", "description", "parameters", "strict"), f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        _known(choice, ("type", "name"), "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name"}', "tool_choice"
    )


def _response_format(text: Any) -> tuple[Any, Any]:
    """text.format -> response_format; text.verbosity."""
    if text is None:
        return None, None
    _known(text, ("format", "verbosity"), "text")
    fmt = text.get("format")
    if fmt is None:
        return None, text.get("verbosity")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        _known(fmt, ("type",), "text.format")
        return {"type": kind}, text.get("verbosity")
    if kind == "json_schema":
        _known(fmt, ("type", "name", "schema", "strict", "description"), "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}, text.get("verbosity")
    raise bad_request("text.format.type must be text, json_object or json_schema", "text.format.type")


def _refuse_state(body: dict[str, Any]) -> None:
    if body.get("previous_response_id") is not None:
        raise bad_request(f"previous_response_id is not available: {STATELESS}", "previous_response_id")
    if body.get("conversation") is not None:
        raise bad_request(f"conversation is not available: {STATELESS}", "conversation")
    if body.get("store") is True:
        raise bad_request(f"store: true is not available: {STATELESS} (send store: false)", "store")
    if body.get("background") is True:
        raise bad_request(
            "background is not available: responses are answered while the call is open", "background"
        )
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(
            "truncation auto is not available: an input longer than the context is refused, never cut",
            "truncation",
        )


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completions body a Responses body stands for (400 naming the Responses field)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for key in body:
        if key not in PASSED and key not in READ:
            raise bad_request(
                f"unknown field {key[:100]!r}: see docs/operations.md (Responses API)", key[:100]
            )
    _refuse_state(body)
    out = {k: body[k] for k in PASSED if body.get(k) is not None}
    out["messages"] = messages(body.get("input"), body.get("instructions"))
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        out["tool_choice"] = choice
    response_format, verbosity = _response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    if verbosity is not None:
        out["verbosity"] = verbosity
    reasoning = body.get("reasoning")
    if reasoning is not None:
        _known(reasoning, ("effort", "summary", "generate_summary"), "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS_INCLUDE for i in include):
        raise bad_request(f"include: only {LOGPROBS_INCLUDE!r} is available here", "include")
    if include:
        out["logprobs"] = True
    else:  # OpenAI returns log probabilities only when `include` asks for them
        out.pop("top_logprobs", None)
    if body.get("stream_options") is not None:
        opts = _known(body["stream_options"], ("include_obfuscation",), "stream_options")
        out["stream_options"] = dict(opts)
    if body.get("stream"):
        out.setdefault("stream_options", {})["include_usage"] = True
    out["store"] = False
    return out


def rename(err: OpenAIError) -> OpenAIError:
    """A chat-path error in the Responses body's words."""
    if err.param:
        for chat, resp in CHAT_TO_RESPONSES.items():
            if err.param == chat or err.param.startswith((chat + ".", chat + "[")):
                err.message = err.message.replace(chat, resp, 1)
                err.param = resp + err.param[len(chat) :]
                break
    return err
