"""Random hostile HTTP bodies against a real OpenAI door (hypothesis): lone surrogates, huge and
boolean numbers, deep JSON, big bodies, wrong types in every field, malformed tool-call histories
and tool lists. Every answer is a status the
client can act on (200, 400, 404, 413) in OpenAI's error shape; never a 500, never a 429 for the
client's own mistake; the door stays healthy.

Shares test_openai_door_limits' door (small limits) over test_service_inference's server.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_openai_door_limits import BODY_LIMIT, HEADER_TIMEOUT, door  # noqa: F401
from tests.integration.test_service_inference import adapters, server  # noqa: F401

FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CLEAN = {200, 400, 404, 413}

surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00\ud800"])
huge_ints = st.sampled_from([2**32, 2**63, -(2**63) - 1, 10**30, 2**32 - 1])
odd_numbers = st.sampled_from([True, False, 1e20, 1e308, -0.0, 0.5, float("nan"), float("inf")])
strings = st.one_of(st.text(max_size=20), surrogates, st.just("a\r\nb"), st.just("x" * 3000))


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), huge_ints, odd_numbers, strings),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=3)),
    max_leaves=10,
)
roles = st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), strings)


@st.composite
def completion_body(draw, base: str):
    body = {
        "model": draw(st.one_of(st.just(base), st.just("alpha"), strings)),
        "prompt": draw(
            st.one_of(
                strings,
                st.lists(strings, max_size=3),
                st.lists(st.one_of(st.integers(0, 1000), huge_ints, st.booleans()), max_size=4),
                values,
            )
        ),
        # a valid max_tokens is small (the fuzzing is about refusals, not generation time)
        "max_tokens": draw(st.one_of(st.integers(1, 2), huge_ints, odd_numbers, strings)),
    }
    for key in draw(st.lists(st.sampled_from(["n", "temperature", "logprobs", "stream", "seed", "stop"]))):
        body[key] = draw(values)
    return body


@st.composite
def chat_body(draw, base: str):
    messages = draw(
        st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": roles, "content": st.one_of(strings, values)},
                ),
                max_size=3,
            ),
            values,
        )
    )
    return {
        "model": draw(st.one_of(st.just(base), strings)),
        "messages": messages,
        "max_tokens": draw(st.one_of(st.integers(1, 2), huge_ints, odd_numbers)),
    }


plain = st.text(st.characters(codec="utf-8"), max_size=10)  # the turns' text is not what is fuzzed here
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
tool_names = st.one_of(
    st.sampled_from(["get_weather", "get_time", "a" * 65, 'f"}\n<|im_end|>']), strings, values
)
functions = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "name": tool_names,
            "arguments": st.one_of(st.sampled_from(['{"city": "Paris"}', "{", "", "[[["]), values),
        },
    ),
    st.sampled_from(["get_weather", 7, 1.5, ["get_weather"], None, True, {}]),
    values,
)
tool_calls = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {"function": functions},
                optional={
                    "id": st.one_of(st.just("call_1"), values),
                    "type": st.one_of(st.just("function"), values),
                },
            ),
            values,
        ),
        min_size=1,
        max_size=3,
    ),
    values,
)
tool_turns = st.one_of(
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "tool_calls": tool_calls},
        optional={"content": st.one_of(st.none(), plain)},
    ),
    st.fixed_dictionaries(
        {"role": st.sampled_from(["tool", "user", "assistant", "system"]), "content": plain},
        optional={
            "tool_call_id": st.one_of(st.just("call_1"), values),
            "name": st.one_of(tool_names, values),
            "tool_calls": tool_calls,
        },
    ),
)
tool_lists = st.one_of(
    st.just([TOOL]),
    st.lists(
        st.one_of(
            st.builds(lambda name: {"type": "function", "function": {"name": name}}, tool_names),
            values,
        ),
        max_size=3,
    ),
    values,
)


@st.composite
def tool_history_body(draw, base: str):
    body = {
        "model": base,
        "messages": [
            {"role": "user", "content": "weather?"},
            *draw(st.lists(tool_turns, min_size=1, max_size=4)),
        ],
        "max_tokens": 1,
        # mostly a valid list, so that the history is what reaches the server
        "tools": draw(st.one_of(st.just([TOOL]), st.just([TOOL]), tool_lists)),
    }
    if draw(st.integers(0, 3)) == 0:
        body["tool_choice"] = draw(
            st.one_of(
                st.sampled_from(["auto", "none", "required"]),
                st.just({"type": "function", "function": {"name": "get_weather"}}),
                values,
            )
        )
    return body


@pytest.fixture(scope="module")
def http(door):  # noqa: F811
    with httpx.Client(base_url=f"http://{door.address}", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def base(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def send(http, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8", "surrogatepass")
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def check(resp: httpx.Response) -> None:
    assert resp.status_code in CLEAN, (resp.status_code, resp.text[:500])
    if resp.status_code != 200:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_random_completion_bodies_get_clean_statuses(http, base, data):
    body = data.draw(completion_body(base))
    if body.get("stream") is True:
        body["stream"] = False  # a 200 stream is read the same; refusals are what is fuzzed here
    check(send(http, "/v1/completions", body))


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_random_chat_bodies_get_clean_statuses(http, base, data):
    check(send(http, "/v1/chat/completions", data.draw(chat_body(base))))


@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_malformed_tool_histories_get_clean_statuses(http, base, data):
    # Issue 59 M4: a tool call whose `function` was a string, number or list was a 500.
    check(send(http, "/v1/chat/completions", data.draw(tool_history_body(base))))


@settings(max_examples=15, **FUZZ)
@given(
    depth=st.integers(900, 30_000),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    where=st.sampled_from(["top", "model", "prompt", "messages"]),
)
def test_deep_json_gets_clean_statuses(http, depth, path, where):
    nested = deep(depth)
    raw = nested if where == "top" else '{"model": "m", "' + where + '": ' + nested + "}"
    check(send(http, path, raw.encode()))


@settings(max_examples=10, **FUZZ)
@given(extra=st.integers(1, 3 * BODY_LIMIT), declared=st.booleans())
def test_big_bodies_are_413(http, base, extra, declared):
    body = json.dumps({"model": base, "prompt": "x" * (BODY_LIMIT + extra), "max_tokens": 1}).encode()
    if declared:
        resp = send(http, "/v1/completions", body)
    else:
        resp = http.post(
            "/v1/completions",
            content=iter([body[i : i + 4096] for i in range(0, len(body), 4096)]),
            headers={"content-type": "application/json"},
        )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_door_healthy_after_fuzzing_and_idle_sockets(door):  # noqa: F811
    host, port = door.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(32)]
    time.sleep(HEADER_TIMEOUT + 1.5)
    for s in idle:
        s.close()
    urllib.request.urlopen(f"http://{door.address}/health", timeout=5).close()
    with urllib.request.urlopen(f"http://{door.address}/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"]
