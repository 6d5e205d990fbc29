"""The Responses API (`POST /v1/responses`) on the real door and server, through the unchanged
`openai` package (responses.create / parse / stream), langchain-openai's use_responses_api and
litellm's `responses`; and litellm's `completion` with the OpenAI options it passes straight through
(`store`, `reasoning_effort`), which the door once refused."""

from __future__ import annotations

import json

import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.integration.test_openai_door import CHAT, base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import adapters, server, stub  # noqa: F401
from tests.support.offline_litellm import LOOPBACK, import_offline, resolved_hosts

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class City(BaseModel):
    name: str
    country: str


def test_text_equals_the_chat_answer(client, base_name):  # noqa: F811
    chat = client.chat.completions.create(
        model=base_name,
        messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_tokens=12,
        temperature=0,
    )
    resp = client.responses.create(
        model=base_name,
        instructions="Be brief.",
        input=CHAT[0]["content"],
        max_output_tokens=12,
        temperature=0,
        store=False,
        metadata={"run": "t1"},
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.metadata == {"run": "t1"} and resp.id.startswith("resp_")
    cut = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    messages = client.responses.create(
        model="alpha",
        input=[{"role": "user", "content": [{"type": "input_text", "text": CHAT[0]["content"]}]}],
        max_output_tokens=8,
        temperature=0,
    )
    assert messages.output[0].type == "message" and messages.output_text
    scored = client.responses.create(
        model=base_name,
        input=CHAT[0]["content"],
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    lps = scored.output[0].content[0].logprobs
    assert len(lps) == scored.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)


def test_tools_and_a_round_trip(client, base_name):  # noqa: F811
    resp = client.responses.create(
        model=base_name,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    if resp.status == "completed":
        assert isinstance(json.loads(calls[0].arguments), dict)
    follow = client.responses.create(
        model=base_name,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert follow.output[0].type == "message" and follow.output_text


def test_structured_output(client, base_name):  # noqa: F811
    resp = client.responses.parse(
        model=base_name,
        input="Name a city and its country as JSON.",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    )
    if resp.status == "completed":
        assert isinstance(resp.output_parsed, City)
    loose = client.responses.create(
        model=base_name,
        input="A JSON object:",
        text={"format": {"type": "json_object"}},
        max_output_tokens=30,
        temperature=0,
    )
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_stream_events(client, base_name):  # noqa: F811
    whole = client.responses.create(model=base_name, input="Say hi.", max_output_tokens=10, temperature=0)
    with client.responses.stream(model=base_name, input="Say hi.", max_output_tokens=10, temperature=0) as s:
        seen = list(s)
    kinds = [e.type for e in seen]
    final = seen[-1].response  # response.completed, or response.incomplete when cut (as OpenAI's)
    assert final.status == whole.status
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta"):
        assert kind in kinds
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    events = list(
        client.responses.create(
            model=base_name,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=30,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_stateless_refusals(client, base_name):  # noqa: F811
    for extra, param in (
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=base_name, input="hi", max_output_tokens=2, **extra)
        assert info.value.param == param, info.value
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=base_name, input="hi", max_output_tokens=0)
    assert info.value.param == "max_output_tokens"


def test_langchain_use_responses_api(door, base_name):  # noqa: F811
    llm = ChatOpenAI(
        base_url=f"http://{door.address}/v1",
        api_key="EMPTY",
        model=base_name,
        use_responses_api=True,
        store=False,
        temperature=0,
        max_tokens=10,
        max_retries=0,
    )
    msg = llm.invoke("What is the capital of France?")
    assert msg.text
    streamed = "".join(chunk.text for chunk in llm.stream("What is the capital of France?"))
    assert streamed == msg.text
    tooled = llm.bind_tools(
        [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice="get_weather",
    ).invoke("Weather in Paris?")
    assert tooled.tool_calls and tooled.tool_calls[0]["name"] == "get_weather"


@pytest.fixture(scope="module")
def litellm():
    return import_offline()


@pytest.fixture(scope="module")
def litellm_door(door, base_name):  # noqa: F811
    # What a litellm user writes for an OpenAI-compatible server: the provider prefix and its /v1.
    return {"model": f"openai/{base_name}", "api_base": f"http://{door.address}/v1", "api_key": "EMPTY"}


def test_litellm_completion_with_openai_options(litellm, litellm_door):
    sent = []  # the body litellm put on the wire, from its own logger_fn hook

    def record(details):
        sent.append(details["additional_args"]["complete_input_dict"])

    call = {**litellm_door, "messages": CHAT, "max_tokens": 8, "temperature": 0, "num_retries": 0}
    with resolved_hosts() as hosts:
        plain = litellm.completion(**call)
        answer = plain.choices[0].message.content
        assert answer and plain.choices[0].finish_reason in ("stop", "length")
        assert 0 < plain.usage.completion_tokens <= 8 and plain.usage.prompt_tokens > 0
        for options in (
            {"store": False},
            {"reasoning_effort": "low"},
            {"store": False, "reasoning_effort": "low", "drop_params": True},
        ):
            resp = litellm.completion(**call, **options, logger_fn=record)
            body = {k: v for k, v in options.items() if k != "drop_params"}
            assert sent[-1].items() >= body.items(), sent[-1]  # passed through, not dropped
            assert resp.choices[0].message.content == answer
            assert resp.usage.completion_tokens == plain.usage.completion_tokens
        streamed = litellm.completion(**call, store=False, reasoning_effort="low", stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
    assert hosts <= LOOPBACK, hosts


def test_litellm_responses(litellm, litellm_door, client, base_name):  # noqa: F811
    # 16: litellm raises a smaller max_output_tokens to OpenAI's minimum for the Responses API
    call = {"input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0}
    direct = client.responses.create(model=base_name, **call)
    with resolved_hosts() as hosts:
        resp = litellm.responses(**litellm_door, **call, store=False)
        events = list(litellm.responses(**litellm_door, **call, stream=True))
        adapter = litellm.responses(
            **{**litellm_door, "model": "openai/alpha"},
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
            max_output_tokens=16,
            temperature=0,
        )
    assert hosts <= LOOPBACK, hosts
    assert resp.output_text and resp.output_text == direct.output_text
    assert resp.status == direct.status and resp.model == base_name
    assert resp.usage.output_tokens == direct.usage.output_tokens > 0
    assert resp.usage.input_tokens == direct.usage.input_tokens
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == direct.output_text
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == direct.usage.output_tokens
    assert adapter.output_text and adapter.model == "alpha"
