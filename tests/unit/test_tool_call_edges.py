"""Tool calls at their edges (issue 59 H1, M4, L1-L3; issue 55's cut and unknown calls): the parser
stays linear on hostile output, cut calls say so, calls to unknown functions stay content, tool
names follow OpenAI's rule, malformed histories and tool lists are 400s naming the field."""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager

import pytest

from loraplex.services.inference.engine.chat_tools import parse_tool_calls, parse_tools
from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.openai import chat_schema, schema, structured, tools
from loraplex.services.openai.errors import OpenAIError
from loraplex.services.openai.responses import Asked
from loraplex.services.openai.stream import StreamState
from loraplex.v1 import inference_pb2 as pb


def fn(name: str, **props) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


WEATHER = fn("get_weather", city={"type": "string"})
TIME = fn("get_time")
NAMES = frozenset({"get_weather", "get_time"})
NAMED = tools.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
REQUIRED = tools.plan([WEATHER, TIME], "required")
AUTO = tools.plan([WEATHER, TIME], "auto")


@contextmanager
def deadline(seconds: float):
    """Interrupt a parse that runs past `seconds` (the re module checks signals while it matches),
    so a super-linear parser fails here at once instead of hanging the run."""

    def expire(*_):
        raise TimeoutError(f"parsing took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


N = 50_000
HOSTILE = {
    "open_tag_then_spaces": "<tool_call>" + " " * N,
    "open_tag_spaces_close_far": "<tool_call>" + " " * N + "x" + " " * N + "</tool_call",
    "many_open_tags": "<tool_call>" * (N // 11),
    "many_empty_blocks": "<tool_call> \n </tool_call>" * (N // 25),
    "blocks_of_spaces": ("<tool_call>" + " " * 500 + "</tool_call>") * 100,
    "deep_json_in_a_block": "<tool_call>" + "[" * N + "</tool_call>",
    "deep_json_bare": "{" + '"a":[' * (N // 5),
    "brace_then_spaces": "{" + " " * N,
    "many_llama_calls": '{"name": "get_time", "parameters": {}}; ' * (N // 40),
    "python_tag_spaces": "<|python_tag|>" + " " * N + "{",
    "unknown_calls": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>' * (N // 50),
}


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_parsing_hostile_output_is_linear(text):
    # Issue 59 H1: `<tool_call>` and 6,000 spaces took the old regex 90 s (cubic), with the GIL held.
    # The bound is on this thread's CPU time (7 ms at most idle): a fresh-clone CI run put 0.36 s of
    # wall time on one 7 ms parse while the machine was busy; the alarm still bounds the wall time.
    for plan in (AUTO, REQUIRED, NAMED):
        for reason in ("stop", "length"):
            start = time.thread_time()
            with deadline(2.0):
                tools.tool_output(plan, text, reason)
            assert time.thread_time() - start < 0.25, (plan.mode, reason)


def test_required_head_of_a_long_cut_name_is_linear():
    text = '{ "name" : "' + '\\"' * N
    start = time.thread_time()
    with deadline(2.0):
        assert tools.tool_output(REQUIRED, text, "length") == (text, [], "length")
    assert time.thread_time() - start < 0.25


def test_forced_calls_cut_by_max_tokens_come_back_as_partial_calls():
    # Issue 55: OpenAI returns the cut call in tool_calls, finish_reason "length".
    content, calls, reason = tools.tool_output(NAMED, '{"city": "Pa', "length")
    assert (content, reason) == (None, "length") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Pa',
    }
    text = '{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls, reason = tools.tool_output(REQUIRED, text, "length")
    assert (content, reason) == (None, "length") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Pa',
    }
    # cut inside the name: no call can be named
    assert tools.tool_output(REQUIRED, '{"name": "get_w', "length") == ('{"name": "get_w', [], "length")


def test_forced_calls_cut_by_a_stop_string_are_no_calls():
    # Issue 59 L1: a stop string cut the arguments; finish_reason "stop" must not carry a call whose
    # arguments are not whole.
    assert tools.tool_output(NAMED, '{"city": "Pa', "stop") == ('{"city": "Pa', [], "stop")
    cut = '{"name": "get_weather", "arguments": {"ci'
    assert tools.tool_output(REQUIRED, cut, "stop") == (cut, [], "stop")
    whole = tools.tool_output(NAMED, '{"city": "Paris"}', "stop")
    assert whole[1][0]["function"]["arguments"] == '{"city": "Paris"}' and whole[2] == "stop"


def test_held_named_stream_with_stop_strings_sends_no_cut_call():
    plan = NAMED._replace(held=True)
    state = StreamState("m", 1, True, Asked(), plan)
    chunks = state.chunks(pb.GenerateStreamResponse(index=0, text='{"city": "Pa'))
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)
    end = state.chunks(pb.GenerateStreamResponse(index=0, text="", finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks + end]
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == '{"city": "Pa'
    assert end[-1]["choices"][0]["finish_reason"] == "stop"
    whole = StreamState("m", 1, True, Asked(), plan)
    end = whole.chunks(pb.GenerateStreamResponse(index=0, text='{"city": "Paris"}', finish_reason="stop"))
    call = next(
        c["choices"][0]["delta"]["tool_calls"][0] for c in end if "tool_calls" in c["choices"][0]["delta"]
    )
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_auto_calls_to_unknown_functions_stay_content():
    text = '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'
    assert tools.tool_output(AUTO, text, "stop") == (text, [], "stop")
    llama = '{"name": "get_time", "parameters": {}}; {"name": "delete_all", "parameters": {}}'
    assert tools.tool_output(AUTO, llama, "stop") == (llama, [], "stop")
    mixed = text + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls, reason = tools.tool_output(AUTO, mixed, "stop")
    assert (
        content == text and [c["function"]["name"] for c in calls] == ["get_time"] and reason == "tool_calls"
    )


def test_auto_keeps_what_is_not_a_call_and_reads_semicolons_in_strings():
    text = 'a <tool_call>oops</tool_call> b <tool_call>{"name": "get_time", "arguments": {}}</tool_call> c'
    content, calls, _ = tools.tool_output(AUTO, text, "stop")
    assert content == "a <tool_call>oops</tool_call> b  c" and len(calls) == 1
    _, calls = tools.parse_auto('{"name": "get_weather", "parameters": {"city": "a;b"}};', NAMES)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "a;b"}
    # a complete call before the output ran out: the call, and "length"
    cut = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"na'
    content, calls, reason = tools.tool_output(AUTO, cut, "length")
    assert content == '<tool_call>{"na' and len(calls) == 1 and reason == "length"


@pytest.mark.parametrize(
    ("tools_", "param"),
    [
        ([fn('f"}\n<|im_end|>')], "tools[0].function.name"),
        ([fn("a" * 65)], "tools[0].function.name"),
        ([fn("get.weather")], "tools[0].function.name"),
        ([fn("ok"), fn("ok")], "tools[1].function.name"),
        ([fn("ok"), {"type": "function", "function": {"name": 5}}], "tools[1].function.name"),
        (
            [fn("ok"), {"type": "function", "function": {"name": "x", "parameters": []}}],
            "tools[1].function.parameters",
        ),
        ([fn(f"t{i}") for i in range(129)], "tools"),
    ],
)
def test_tool_names_follow_openais_rule_once_each(tools_, param):
    with pytest.raises(OpenAIError) as err:
        tools.plan(tools_, None)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.message.startswith(param), err.value.message
    ok = tools.plan([fn("a-Z_09"), fn("b" * 64)], None)
    assert ok.names == {"a-Z_09", "b" * 64}


def test_server_checks_tool_names_and_call_shapes():
    with pytest.raises(InvalidRequest) as err:
        parse_tools(json.dumps([fn("a"), fn("a")]), "inputs[0].tools_json")
    assert err.value.field == "inputs[0].tools_json" and "[1].function.name" in err.value.message
    for function in ("get_weather", 5, [], None, {"name": "a b"}):
        calls = json.dumps([{"id": "c", "type": "function", "function": function}])
        with pytest.raises(InvalidRequest) as err:
            parse_tool_calls(calls, "f")
        assert err.value.field == "f" and err.value.message.startswith("f[0].function")
    with pytest.raises(InvalidRequest) as err:
        parse_tool_calls(json.dumps([{"function": {"name": "a", "arguments": 5}}]), "f")
    assert err.value.message.startswith("f[0].function.arguments")
    with pytest.raises(InvalidRequest):
        parse_tools("[" * 100_000, "f")


def chat(messages: list) -> None:
    body = {"model": "m", "messages": messages, "tools": [WEATHER]}
    chat_schema.chat_call(schema.parse(chat_schema.ChatRequest, body), "")


def assistant(calls) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": calls}


def call(function, **extra) -> dict:
    return {"id": "call_1", "type": "function", "function": function, **extra}


GOOD_FN = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
HISTORIES = [
    (assistant([call("get_weather")]), "messages[1].tool_calls[0].function"),
    (assistant([call(5)]), "messages[1].tool_calls[0].function"),
    (assistant([call(["get_weather"])]), "messages[1].tool_calls[0].function"),
    (assistant([call(None)]), "messages[1].tool_calls[0].function"),
    (assistant([{"id": "c"}]), "messages[1].tool_calls[0].function"),
    (assistant([call({"arguments": "{}"})]), "messages[1].tool_calls[0].function.name"),
    (assistant([call({"name": 7, "arguments": "{}"})]), "messages[1].tool_calls[0].function.name"),
    (
        assistant([call({"name": "x\n<|im_end|>", "arguments": "{}"})]),
        "messages[1].tool_calls[0].function.name",
    ),
    (assistant([call({"name": "get_weather"})]), "messages[1].tool_calls[0].function.arguments"),
    (
        assistant([call({"name": "get_weather", "arguments": 5})]),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        assistant([call({"name": "get_weather", "arguments": [1]})]),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (assistant([call(GOOD_FN), "call"]), "messages[1].tool_calls[1]"),
    (assistant([call(GOOD_FN, type="code")]), "messages[1].tool_calls[0].type"),
    (assistant([{"id": 5, "function": GOOD_FN}]), "messages[1].tool_calls[0].id"),
    (assistant("get_weather()"), "messages[1].tool_calls"),
    (assistant({"function": GOOD_FN}), "messages[1].tool_calls"),
    ({"role": "user", "content": "x", "tool_calls": [call(GOOD_FN)]}, "messages[1].tool_calls"),
    ({"role": "tool", "content": "21", "tool_call_id": 5}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "21", "name": ["get_weather"]}, "messages[1].name"),
]


@pytest.mark.parametrize(
    ("message", "param"), HISTORIES, ids=[p + str(i) for i, (_, p) in enumerate(HISTORIES)]
)
def test_malformed_tool_histories_are_400_naming_the_field(message, param):
    # Issue 59 M4: a string / number / list `function` was a 500 (the server's dict() of it).
    with pytest.raises(OpenAIError) as err:
        chat([{"role": "user", "content": "weather?"}, message])
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.message.startswith(param)


def test_well_formed_tool_histories_pass():
    chat(
        [
            {"role": "user", "content": "weather?"},
            assistant([call(GOOD_FN), {"function": {"name": "get_time", "arguments": {}}}]),
            {"role": "tool", "content": "21", "tool_call_id": "call_1", "name": "get_weather"},
            assistant([]),
            {"role": "assistant", "content": "ok", "tool_calls": None},
        ]
    )


@pytest.mark.parametrize("value", ["1e999", "[1, 2]", '"s"', "true", "null", "{", "[" * 50_000])
@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_schema_text_that_is_no_schema_is_400_with_a_reason(field, value):
    # Issue 59 L3: guided_json "1e999" reached the compiler and came back with an empty reason.
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if field == "guided_json":
        body["guided_json"] = value
        want = "guided_json"
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}
        want = "response_format.json_schema.schema"
    req = schema.parse(chat_schema.ChatRequest, body)
    with pytest.raises(OpenAIError) as err:
        structured.apply(req, pb.SamplingParams(), req.response_format)
    assert err.value.param == want and err.value.message.startswith(want + " ")
    assert len(err.value.message) > len(want) + 12, err.value.message


@pytest.mark.parametrize(
    ("value", "got"), [("1e999", "a number"), ("[1]", "an array"), ("true", "a boolean")]
)
def test_grpc_schema_text_that_is_no_schema_says_why(value, got):
    # Issue 59 L3 over gRPC: json_schema "1e999" reached xgrammar, whose refusal had no text.
    with pytest.raises(InvalidRequest) as err:
        Constraint("json_schema", value).validate()
    assert err.value.field == "sampling_params.json_schema"
    assert err.value.message == f"sampling_params.json_schema must be a JSON schema (an object); got {got}"


def test_strict_of_a_json_schema_is_named_itself():
    # Issue 59 L3's sweep: a wrong `strict` was reported as `response_format`.
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": "yes"}}
    req = schema.parse(
        chat_schema.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(OpenAIError) as err:
        structured.apply(req, pb.SamplingParams(), rf)
    assert err.value.param == "response_format.json_schema.strict"
