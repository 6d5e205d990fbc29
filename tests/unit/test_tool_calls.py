"""Tool calls: parsing the model's own formats (services/openai/tools.py), rendering tools through a
chat template that knows them and one that does not (engine/chat_tools.py), the door's checks of
tools / tool_choice / response_format, and the held stream of a tool call."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from loraplex.services.inference.engine.chat import render_model_template
from loraplex.services.openai import chat_schema, schema, tools
from loraplex.services.openai.errors import OpenAIError
from loraplex.services.openai.responses import Asked
from loraplex.services.openai.stream import StreamState
from loraplex.v1 import inference_pb2 as pb

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A template that renders tools the way Llama 3.1's / Qwen's do (their text differs; the seam is the same).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


NAMES = frozenset({"get_weather", "a", "b"})


def test_parse_hermes_qwen_blocks():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = tools.parse_auto(text, NAMES)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_parse_llama31_json_calls():
    content, calls = tools.parse_auto(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', NAMES
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, two = tools.parse_auto('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', NAMES)
    assert [c["function"]["name"] for c in two] == ["a", "b"]


@pytest.mark.parametrize(
    "text", ["Paris is sunny.", '{"city": "Paris"}', "<tool_call>not json</tool_call>", "{"]
)
def test_plain_answers_stay_content(text):
    assert tools.parse_auto(text, NAMES) == (text, [])


def test_required_and_named_outputs():
    required = tools.plan([WEATHER], "required")
    params = pb.SamplingParams()
    assert tools.constrain(required, params) == {"sampling_params.json_schema": "tools.function.parameters"}
    schema_ = json.loads(params.json_schema)
    assert schema_["properties"]["name"] == {"const": "get_weather"}
    content, calls, reason = tools.tool_output(
        required, '{"name": "get_weather", "arguments": {"city": "Rome"}}', "stop"
    )
    assert content is None and reason == "tool_calls" and calls[0]["function"]["name"] == "get_weather"
    named = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    content, calls, reason = tools.tool_output(named, '{"city": "Rome"}', "stop")
    assert calls[0]["function"]["arguments"] == '{"city": "Rome"}' and reason == "stop"
    # Cut short by max_tokens: the partial arguments, and "length" says so (as OpenAI answers).
    content, calls, reason = tools.tool_output(named, '{"city": "Ro', "length")
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Ro' and reason == "length"


@pytest.mark.parametrize(
    ("tools_", "choice", "param"),
    [
        ([{"type": "function"}], None, "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_bad_tools_are_400(tools_, choice, param):
    with pytest.raises(OpenAIError) as err:
        tools.plan(tools_, choice)
    assert err.value.status == 400 and err.value.param == param


def test_chat_call_carries_tools_and_refuses_two_constraints():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    call = chat_schema.chat_call(schema.parse(chat_schema.ChatRequest, body), "")
    assert json.loads(call.request.inputs[0].tools_json) == [WEATHER] and call.tool_plan.mode == "auto"
    assert call.request.sampling_params.WhichOneof("constraint") is None
    with pytest.raises(OpenAIError) as err:
        chat_schema.chat_call(
            schema.parse(
                chat_schema.ChatRequest,
                {**body, "tool_choice": "required", "response_format": {"type": "json_object"}},
            ),
            "",
        )
    assert err.value.param == "tool_choice"


def test_render_passes_tools_to_a_template_that_knows_them(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
            ],
        },
    ]
    tok.chat_template = TOOL_TEMPLATE
    text = render_model_template(tok, messages, True, tools=[WEATHER])
    assert text.startswith("TOOLS:get_weather;") and 'CALL get_weather {"city": "Rome"}' in text


def test_render_describes_tools_to_a_template_that_does_not(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)  # SmolLM2's template has no tools
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    text = render_model_template(tok, messages, True, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou may call functions") and '"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny" in text
    # A history with calls but no tools now: the calls still show in the assistant's turn.
    text = render_model_template(tok, messages, True)
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather"' in text and "You may call" not in text


def test_stream_holds_an_auto_or_required_call_until_the_end():
    plan = tools.plan([WEATHER], "required")
    state = StreamState("m", 1, True, Asked(), plan)
    chunks = state.chunks(pb.GenerateStreamResponse(index=0, text='{"name": "get_weather", '))
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)
    assert all(not c["choices"][0]["delta"].get("content") for c in chunks)
    end = state.chunks(
        pb.GenerateStreamResponse(index=0, text='"arguments": {"city": "Rome"}}', finish_reason="stop")
    )
    deltas = [c["choices"][0]["delta"] for c in end]
    call = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert end[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_of_a_named_function_streams_its_arguments():
    plan = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    state = StreamState("m", 1, True, Asked(), plan)
    chunks = state.chunks(pb.GenerateStreamResponse(index=0, text='{"city": '))
    chunks += state.chunks(pb.GenerateStreamResponse(index=0, text='"Rome"}', finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    assert len(calls) == 3 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
