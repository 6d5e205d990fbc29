"""The Responses API's translation (no server): a Responses body -> the chat body it stands for, a
chat answer -> the Response object, chat stream chunks -> Responses events."""

from __future__ import annotations

import json

import pytest

from loraplex.services.openai import chat_schema
from loraplex.services.openai import responses_api as api
from loraplex.services.openai import responses_api_output as output
from loraplex.services.openai.errors import OpenAIError
from loraplex.services.openai.responses_api_stream import ResponseEvents

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def test_items_become_chat_messages():
    body = api.chat_body(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "done"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
                "verbosity": "low",
            },
            "reasoning": {"effort": "low"},
            "max_output_tokens": 7,
            "store": False,
        }
    )
    msgs = body["messages"]
    assert msgs[0] == {"role": "system", "content": "Be brief."} and msgs[1] == {
        "role": "user",
        "content": "ab",
    }
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one assistant turn
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "done", "name": "f"}
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": TOOL["parameters"]}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert (body["max_tokens"], body["verbosity"], body["reasoning_effort"]) == (7, "low", "low")
    del body["response_format"]  # a named tool already constrains the output: one constraint a call
    req, _ = chat_schema.parse_chat(body)  # the chat path takes it as it is
    call = chat_schema.chat_call(req, "")
    assert json.loads(call.request.inputs[0].chat_template_kwargs_json) == {
        "reasoning_effort": "low",
        "verbosity": "low",
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "c"}, "conversation"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"include": ["file_search_call.results"]}, "include"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"text": {"format": {"type": "text"}, "bogus": 1}}, "text.bogus"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_refusals_name_the_responses_field(extra, param):
    with pytest.raises(OpenAIError) as info:
        api.chat_body({"model": "m", "input": "hi", **extra})
    assert info.value.param == param


def test_chat_errors_are_renamed():
    with pytest.raises(OpenAIError) as info:
        chat_schema.parse_chat(api.chat_body({"model": "m", "input": "hi", "max_output_tokens": 0}))
    err = api.rename(info.value)
    assert err.param == "max_output_tokens" and "max_output_tokens" in err.message


def _chat(content, calls=None, reason="stop"):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    return {"choices": [{"message": message, "finish_reason": reason, "logprobs": None}], "usage": usage}


def test_response_object():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    resp = output.response_object({"metadata": {"k": "v"}}, "m", _chat(None, [call], "tool_calls"))
    assert [o["type"] for o in resp["output"]] == ["function_call"] and resp["output"][0][
        "call_id"
    ] == "call_1"
    assert resp["status"] == "completed" and resp["metadata"] == {"k": "v"}
    assert resp["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    cut = output.response_object({}, "m", _chat("Hel", reason="length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "Hel"


def test_events_add_up_to_the_object():
    events = ResponseEvents({}, "m")
    out = events.start()
    for delta in ("Hel", "lo"):
        out += events.chunk(
            {"choices": [{"index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}]}
        )
    out += events.chunk({"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]})
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    out += events.chunk({"choices": [], "usage": usage})
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    done = out[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello" and done["usage"]["output_tokens"] == 2
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []


def test_obfuscation_pads_delta_events_only_when_asked():
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}]}
    padded = ResponseEvents({}, "m", obfuscation=True)
    events = padded.start() + padded.chunk(chunk)
    assert all(("obfuscation" in e) == e["type"].endswith(".delta") for e in events)
    plain = ResponseEvents({}, "m")
    assert not any("obfuscation" in e for e in plain.start() + plain.chunk(chunk))
    body = api.chat_body(
        {"model": "m", "input": "hi", "stream": True, "stream_options": {"include_obfuscation": True}}
    )
    assert body["stream_options"] == {"include_obfuscation": True, "include_usage": True}
