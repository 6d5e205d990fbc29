"""Structured outputs and tool calls through the OpenAI door on the embedded SmolLM2 (the shared
server of test_service_inference): the `openai` SDK's parse path, vLLM's guided_* and
structured_outputs spellings, tools with tool_choice required / named / auto, streamed and not,
langchain-openai's with_structured_output and bind_tools; errors name the caller's field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.test_openai_door import base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import adapters, server  # noqa: F401

ASK = [{"role": "user", "content": "Name a European country and its capital."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Capital(BaseModel):
    country: str = Field(max_length=24)
    capital: str = Field(max_length=24)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=24)
    celsius: bool


@pytest.mark.parametrize("model", ["base", "alpha"])
def test_sdk_parse_returns_a_parsed_object(client, base_name, model):  # noqa: F811
    resp = client.chat.completions.parse(
        model=base_name if model == "base" else model,
        messages=ASK,
        response_format=Capital,
        max_tokens=60,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital)


def test_json_object_and_sampled_schema(client, base_name):  # noqa: F811
    schema = Capital.model_json_schema()
    for temperature, seed in ((0, None), (1.0, 3), (1.0, 4)):
        resp = client.chat.completions.create(
            model=base_name,
            messages=ASK,
            max_tokens=60,
            temperature=temperature,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"guided_regex": "(yes|no), [a-z]{2,8}"},
        {"structured_outputs": {"regex": "(yes|no), [a-z]{2,8}"}},
        {"guided_grammar": 'root ::= "yes" | "no"'},
    ],
)
def test_vllm_spellings_on_completions(client, base_name, extra):  # noqa: F811
    resp = client.completions.create(
        model="alpha", prompt="Is Paris in France?", max_tokens=20, temperature=0.8, seed=1, extra_body=extra
    )
    text = resp.choices[0].text
    assert resp.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no)(, [a-z]{2,8})?", text), text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= x"}}), "structured_outputs.grammar"),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (dict(extra_body={"guided_choice": ["a"], "guided_regex": "a"}), "guided_choice"),
        (dict(extra_body={"guided_grammar": "root ::= root"}), "guided_grammar"),  # admits nothing
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "not": {"const": "a"}}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (dict(response_format={"type": "xml"}), "response_format.type"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(client, base_name, kwargs, param):  # noqa: F811
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=base_name, messages=ASK, max_tokens=5, stream=stream, **kwargs
            )
        assert info.value.status_code == 400 and info.value.param == param, info.value.message
        assert info.value.type == "invalid_request_error"


def test_min_tokens_past_the_constraints_end_is_400(client, base_name):  # noqa: F811
    """Found while decoding (the choice ends after one word, min_tokens wants five): a 400 naming
    min_tokens, never a 200 with finish_reason "abort"."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=base_name,
            messages=ASK,
            max_tokens=8,
            extra_body={"guided_choice": ["yes", "no"], "min_tokens": 5},
        )
    assert info.value.status_code == 400 and info.value.param == "min_tokens", info.value.message
    assert "ends after" in info.value.message


def test_tool_choice_required_and_named(client, base_name):  # noqa: F811
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.chat.completions.create(
        model="alpha",
        messages=ask,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    tool = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    named = {"type": "function", "function": {"name": "get_time"}}
    streamed = client.chat.completions.create(
        model=base_name, messages=ask, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, stream=True
    )
    calls, reasons = {}, []
    for chunk in streamed:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["stop"] and calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])


def test_tool_conversation_renders_and_auto_answers(client, base_name):  # noqa: F811
    """A whole tool round trip (assistant tool_calls, a tool message) renders through the template;
    with tool_choice auto the answer is content or parsed calls, never both missing."""
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    resp = client.chat.completions.create(
        model=base_name, messages=history, tools=[WEATHER], max_tokens=20, temperature=0
    )
    msg = resp.choices[0].message
    assert msg.content or msg.tool_calls
    none = client.chat.completions.create(
        model=base_name, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_langchain_structured_output_and_bind_tools(door, base_name):  # noqa: F811
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=base_name, base_url=f"http://{door.address}/v1", api_key="EMPTY", temperature=0, max_tokens=60
    )
    capital = llm.with_structured_output(Capital).invoke("Name a European country and its capital.")
    assert isinstance(capital, Capital)

    @tool
    def get_weather(city: str, celsius: bool) -> str:
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert set(message.tool_calls[0]["args"]) == {"city", "celsius"}
    assert isinstance(message.tool_calls[0]["args"]["celsius"], bool)
