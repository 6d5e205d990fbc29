"""Tool calls at their edges through the real door on the embedded SmolLM2 (issue 59 H1, M4, L1-L3;
issue 55's cut calls and unknown functions). Outputs are forced with `guided_regex` (allowed beside
tool_choice auto) so each case is the same on every run.

Shares test_openai_door's door over test_service_inference's shared server.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import openai
import pytest

from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_openai_door import base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import adapters, server, stub  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def http(door):  # noqa: F811
    with httpx.Client(base_url=f"http://{door.address}", timeout=120) as c:
        yield c


def chat(http, base_name, **body) -> httpx.Response:  # noqa: F811
    return http.post("/v1/chat/completions", json={"model": base_name, "messages": ASK, **body})


def test_health_answers_while_a_big_request_is_read(http, door, base_name):  # noqa: F811
    # Issue 59 H1: the door's per-request CPU work ran on its event loop, so one request froze every
    # HTTP call. Here: 500,000 prompts whose first has a lone surrogate (found last by the body's
    # check, ~3 s of Python on a small machine); /health must answer within a second throughout.
    # (The hostile tool output itself, `<tool_call>` and spaces, is timed in tests/unit: generating
    # thousands of spaces here would take minutes on CPU.)
    body = json.dumps({"model": base_name, "prompt": ["\ud800"] + ["a"] * 500_000, "max_tokens": 1})
    raw = body.encode("utf-8", "surrogatepass")
    result: dict = {}

    def ask():
        result["resp"] = http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )

    worker = threading.Thread(target=ask)
    worker.start()
    slowest, probes = 0.0, 0
    with httpx.Client(base_url=f"http://{door.address}", timeout=30) as probe:
        while worker.is_alive():
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            slowest, probes = max(slowest, time.monotonic() - start), probes + 1
            time.sleep(0.05)
    worker.join()
    resp = result["resp"]
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt[0]", resp.text
    assert probes >= 3 and slowest < 1.0, (probes, slowest)


def test_forced_call_cut_by_max_tokens_is_a_partial_call(client, base_name):  # noqa: F811
    # Issue 55: OpenAI returns the cut call in tool_calls with finish_reason "length".
    resp = client.chat.completions.create(
        model=base_name, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=3, temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    args = choice.message.tool_calls[0].function.arguments
    assert choice.message.tool_calls[0].function.name == "get_weather" and args.startswith("{")
    with pytest.raises(ValueError):
        json.loads(args)
    required = client.chat.completions.create(
        model=base_name, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=16, temperature=0
    )
    choice = required.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls, choice.message
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].function.arguments.startswith("{")


def test_langchain_structured_output_sees_the_cut_call(door, base_name):  # noqa: F811
    # Issue 55: with_structured_output(method="function_calling") got None and no sign of the cut.
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    llm = ChatOpenAI(
        model=base_name, base_url=f"http://{door.address}/v1", api_key="EMPTY", temperature=0, max_tokens=3
    )
    out = llm.with_structured_output(City, method="function_calling", include_raw=True).invoke(
        "Paris weather?"
    )
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "length"
    # the cut call, as langchain reads OpenAI's answer: an invalid tool call with the partial arguments
    # (langchain's parser then gives parsed None, as it does against OpenAI: include_raw shows why)
    assert not raw.tool_calls and raw.invalid_tool_calls, raw
    assert raw.invalid_tool_calls[0]["name"] == "City" and raw.invalid_tool_calls[0]["args"].startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_cut_by_a_stop_string_is_no_call(http, base_name, stream):  # noqa: F811
    # Issue 59 L1: the `"` stop string cuts `{"city": ...` after its first character.
    resp = chat(
        http,
        base_name,
        tools=[WEATHER],
        tool_choice=NAMED,
        stop=['"'],
        max_tokens=20,
        temperature=0,
        stream=stream,
    )
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "{"
        return
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "{"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_auto_call_to_an_unknown_function_is_content(http, base_name):  # noqa: F811
    # Issue 55: under tool_choice auto a call to a function not in `tools` was returned unchecked.
    for name, is_call in (("delete_all", False), ("get_weather", True)):
        text = f'<tool_call>{{"name": "{name}", "arguments": {{"city": "Paris"}}}}</tool_call>'
        regex = text.replace("{", r"\{").replace("}", r"\}")
        resp = chat(http, base_name, tools=[WEATHER], guided_regex=regex, max_tokens=60, temperature=0)
        choice = resp.json()["choices"][0]
        if is_call:
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        else:
            assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text
            assert "tool_calls" not in choice["message"]


def _history(function) -> list:
    call = {"id": "call_1", "type": "function", "function": function}
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]


@pytest.mark.parametrize(
    ("function", "param"),
    [
        ("get_weather", "messages[1].tool_calls[0].function"),
        (7, "messages[1].tool_calls[0].function"),
        (["get_weather"], "messages[1].tool_calls[0].function"),
        ({"arguments": "{}"}, "messages[1].tool_calls[0].function.name"),
        ({"name": "get_weather", "arguments": 5}, "messages[1].tool_calls[0].function.arguments"),
    ],
)
def test_malformed_tool_history_is_400_naming_the_field(http, base_name, function, param):  # noqa: F811
    # Issue 59 M4: a string / number / list `function` was HTTP 500 (INTERNAL from the server).
    resp = http.post(
        "/v1/chat/completions",
        json={"model": base_name, "messages": _history(function), "tools": [WEATHER], "max_tokens": 2},
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize("function", ["get_weather", 7, [1], {"name": "x y", "arguments": "{}"}])
def test_malformed_tool_history_over_grpc_is_invalid_argument(stub, function):  # noqa: F811
    message = pb.ChatMessage(
        role="assistant", tool_calls_json=json.dumps([{"id": "c", "type": "function", "function": function}])
    )
    req = pb.GenerateRequest(
        inputs=[pb.Input(messages=[pb.ChatMessage(role="user", content="hi"), message])],
        sampling_params=pb.SamplingParams(max_new_tokens=1),
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].messages[1].tool_calls_json[0].function" in err.value.details()


def _tool(name) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [_tool('f"}\n<|im_end|>')]}, "tools[0].function.name", "letters, digits"),
        ({"tools": [_tool("a"), _tool("a")]}, "tools[1].function.name", "twice"),
        ({"tools": [_tool(f"t{i}") for i in range(129)]}, "tools", "at most 128"),
        ({"guided_json": "1e999"}, "guided_json", "JSON schema (an object)"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "[1]"}}},
            "response_format.json_schema.schema",
            "JSON schema (an object)",
        ),
    ],
)
def test_tool_names_and_schema_texts_are_400_naming_the_field(http, base_name, body, param, says):  # noqa: F811
    # Issue 59 L2 (names reached the prompt, duplicates accepted) and L3 (129 tools were reported as
    # `messages`; guided_json "1e999" gave an empty reason).
    resp = chat(http, base_name, max_tokens=2, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and says in error["message"], error


def test_tools_over_grpc_name_the_field(http, stub):  # noqa: F811
    req = pb.GenerateRequest(
        inputs=[
            pb.Input(
                messages=[pb.ChatMessage(role="user", content="hi")],
                tools_json=json.dumps([_tool("a"), _tool("a")]),
            )
        ],
        sampling_params=pb.SamplingParams(max_new_tokens=1),
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[1].function.name" in err.value.details()


def test_openai_sdk_gets_bad_request_for_a_bad_history(client, base_name):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=base_name, messages=_history("get_weather"), tools=[WEATHER], max_tokens=2
        )
    assert err.value.param == "messages[1].tool_calls[0].function"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"max_completion_tokens": 5000}, "max_completion_tokens", "max_completion_tokens 5000 exceeds"),
        ({"max_completion_tokens": 2, "min_tokens": 5}, "min_tokens", "[0, max_completion_tokens]"),
        ({"max_tokens": 2, "min_tokens": 5}, "min_tokens", "[0, max_tokens]"),
    ],
)
def test_server_limits_are_named_as_the_caller_wrote_them(http, base_name, body, param, says):  # noqa: F811
    # Issue 59 L3's sweep of the door's limit messages: the server's max_new_tokens was reported as
    # max_tokens to a caller who wrote max_completion_tokens, and min_tokens' bound named max_new_tokens.
    resp = chat(http, base_name, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (
        error["param"] == param and says in error["message"] and "max_new_tokens" not in error["message"]
    ), error
