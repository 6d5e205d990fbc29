"""Every field of docs/operations.md's table through the real door and server (the shared SmolLM2
server and door of test_openai_door.py): published clients unmodified (openai, langchain-openai) and
raw HTTP bodies as vLLM and OpenAI users write them. Each field's effect is checked where it has one."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from tests.integration.test_openai_door import CHAT, base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import PROMPTS, adapters, server, stub  # noqa: F401

GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def http(door):  # noqa: F811
    with httpx.Client(base_url=f"http://{door.address}", timeout=60) as c:
        yield c


def post(http, path: str, body: dict) -> tuple[int, dict]:
    resp = http.post(path, json=body)
    return resp.status_code, resp.json()


def sse(http, path: str, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_openai_advisory_fields_change_nothing(client, base_name):  # noqa: F811
    plain = client.chat.completions.create(model=base_name, messages=CHAT, **GREEDY)
    advised = client.chat.completions.create(
        model=base_name,
        messages=CHAT,
        store=False,
        service_tier="auto",
        reasoning_effort="low",
        verbosity="low",
        metadata={"team": "qa"},
        prompt_cache_key="faq",
        safety_identifier="user-1",
        user="u",
        modalities=["text"],
        prediction={"type": "content", "content": "Paris is the capital"},
        extra_body={"prompt_cache_retention": "24h"},
        **GREEDY,
    )
    assert advised.choices[0].message.content == plain.choices[0].message.content
    assert advised.service_tier == "default"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=base_name, messages=CHAT, modalities=["text", "audio"], **GREEDY)
    assert info.value.param == "modalities" and "text only" in info.value.message


def test_langchain_with_openai_options(door, base_name):  # noqa: F811
    llm = ChatOpenAI(
        base_url=f"http://{door.address}/v1",
        api_key="EMPTY",
        model=base_name,
        store=False,
        service_tier="auto",
        reasoning_effort="low",
        verbosity="low",
        logit_bias={"28": 1.0},
        temperature=0,
        max_tokens=8,
        max_retries=0,
    )
    msg = llm.invoke("What is the capital of France?")
    assert msg.content and msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.response_metadata.get("service_tier") == "default"
    streamed = "".join(c.content for c in llm.stream("What is the capital of France?"))
    assert streamed == msg.content


def test_logit_bias_steers_the_output(client, base_name):  # noqa: F811
    plain = client.completions.create(model=base_name, prompt=PROMPTS[1], logprobs=0, **GREEDY)
    first = plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(
        model=base_name,
        prompt=PROMPTS[1],
        logit_bias={"28": 100},
        extra_body={"return_tokens_as_token_ids": True},
        logprobs=0,
        **GREEDY,
    )
    assert forced.choices[0].logprobs.tokens == ["token_id:28"] * 8
    banned = client.completions.create(
        model=base_name, prompt=PROMPTS[1], logprobs=0, extra_body={"bad_words": [first.strip()]}, **GREEDY
    )
    assert first.strip() not in banned.choices[0].text
    allowed = client.chat.completions.create(
        model=base_name,
        messages=CHAT,
        logprobs=True,
        extra_body={"allowed_token_ids": [28, 29, 30], "return_tokens_as_token_ids": True},
        **GREEDY,
    )
    assert {t.token for t in allowed.choices[0].logprobs.content} <= {
        "token_id:28",
        "token_id:29",
        "token_id:30",
    }


def test_vllm_prompt_and_stop_fields(http, base_name):  # noqa: F811
    status, full = post(http, "/v1/completions", {"model": base_name, "prompt": PROMPTS[0], **GREEDY})
    assert status == 200
    text = full["choices"][0]["text"]
    stop = text[2:5]
    status, kept = post(
        http,
        "/v1/completions",
        {
            "model": base_name,
            "prompt": PROMPTS[0],
            "stop": [stop],
            "include_stop_str_in_output": True,
            **GREEDY,
        },
    )
    assert status == 200 and kept["choices"][0]["text"] == text[: text.find(stop) + len(stop)]
    status, cut = post(
        http,
        "/v1/completions",
        {
            "model": base_name,
            "prompt": PROMPTS[0],
            "truncate_prompt_tokens": 3,
            "request_id": "abc-1",
            **GREEDY,
        },
    )
    assert status == 200 and cut["usage"]["prompt_tokens"] == 3 and cut["id"] == "cmpl-abc-1"
    for body in (
        {"priority": -5},
        {"priority": 7},
        {"guided_decoding_backend": "auto"},
        {"add_special_tokens": False},  # SmolLM2's tokenizer adds none: the same prompt
    ):
        status, got = post(
            http, "/v1/completions", {"model": base_name, "prompt": PROMPTS[0], **body, **GREEDY}
        )
        assert status == 200 and got["choices"][0]["text"] == text, body
    status, err = post(
        http, "/v1/completions", {"model": base_name, "prompt": "hi", "guided_decoding_backend": "outlines"}
    )
    assert status == 400 and err["error"]["param"] == "guided_decoding_backend"


def test_cache_salt_isolates_cached_prefixes(http, base_name):  # noqa: F811
    prompt = "Salted prefix " + "lorem ipsum dolor sit amet " * 12

    def cached(**extra) -> int:
        body = {"model": base_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        status, got = post(http, "/v1/completions", body)
        assert status == 200, got
        return got["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0


def test_chat_template_fields(http, base_name):  # noqa: F811
    msgs = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": base_name, "messages": msgs, "add_generation_prompt": False, **GREEDY}
    status, cont = post(http, "/v1/chat/completions", {**body, "continue_final_message": True, "echo": True})
    assert status == 200, cont
    content = cont["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is") and len(content) > len("The capital of France is")
    status, closed = post(http, "/v1/chat/completions", body)
    # left open, the final message's end-of-turn is not in the prompt
    assert status == 200 and closed["usage"]["prompt_tokens"] > cont["usage"]["prompt_tokens"]
    status, kw = post(
        http,
        "/v1/chat/completions",
        {"model": base_name, "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}, **GREEDY},
    )
    assert status == 200
    status, err = post(
        http,
        "/v1/chat/completions",
        {"model": base_name, "messages": CHAT, "chat_template_kwargs": {"messages": []}},
    )
    assert status == 400 and "chat_template_kwargs" in err["error"]["param"], err


def test_structured_fields(http, base_name):  # noqa: F811
    status, got = post(
        http,
        "/v1/completions",
        {
            "model": base_name,
            "prompt": "A JSON object:",
            "response_format": {"type": "json_object"},
            "max_tokens": 40,
            "temperature": 0,
        },
    )
    assert status == 200
    if got["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(got["choices"][0]["text"]), dict)
    for so in (
        {"json": {"type": "object"}, "disable_any_whitespace": False},
        {"json": {"type": "object"}, "disable_any_whitespace": True},
    ):
        status, got = post(
            http,
            "/v1/completions",
            {
                "model": base_name,
                "prompt": "A JSON object:",
                "structured_outputs": so,
                "max_tokens": 4,
                "temperature": 0,
            },
        )
        assert status == 200, got
    status, err = post(
        http,
        "/v1/completions",
        {"model": base_name, "prompt": "x", "guided_json": {}, "guided_whitespace_pattern": " "},
    )
    assert status == 400 and err["error"]["param"] == "guided_whitespace_pattern"


def test_stream_usage_on_every_chunk(http, base_name):  # noqa: F811
    chunks = sse(
        http,
        "/v1/chat/completions",
        {
            "model": base_name,
            "messages": CHAT,
            "stream_options": {
                "include_usage": True,
                "continuous_usage_stats": True,
                "include_obfuscation": True,
            },
            "service_tier": "auto",
            **GREEDY,
        },
    )
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all("usage" in c and "obfuscation" in c for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and chunks[-1]["usage"]["completion_tokens"] == counts[-1] > 0
    assert all(c["service_tier"] == "default" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_functions_as_tools(http, base_name):  # noqa: F811
    fn = {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    body = {
        "model": base_name,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "functions": [fn],
        "function_call": {"name": "get_weather"},
        "temperature": 0,
        "max_tokens": 30,
    }
    status, got = post(http, "/v1/chat/completions", body)
    assert status == 200, got
    message = got["choices"][0]["message"]
    assert message["function_call"]["name"] == "get_weather" and "tool_calls" not in message
    if got["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(message["function_call"]["arguments"]), dict)
    chunks = sse(http, "/v1/chat/completions", body)
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert any("function_call" in d for d in deltas) and not any("tool_calls" in d for d in deltas)
    history = [
        *body["messages"],
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    status, got = post(
        http, "/v1/chat/completions", {"model": base_name, "messages": history, "functions": [fn], **GREEDY}
    )
    assert status == 200, got


def test_grpc_add_special_tokens_is_for_text(stub):  # noqa: F811
    import grpc

    from loraplex.v1 import inference_pb2 as pb

    text = pb.Input(text=PROMPTS[1], add_special_tokens=False)
    params = pb.SamplingParams(max_new_tokens=1)
    done = stub.Generate(pb.GenerateRequest(inputs=[text], sampling_params=params)).completions[0]
    assert done.prompt_tokens == len(stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[1])).token_ids)
    chat = pb.Input(messages=[pb.ChatMessage(role="user", content="hi")], add_special_tokens=False)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(inputs=[chat], sampling_params=params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs[0].add_special_tokens" in info.value.details()


ACCEPTED = {  # advisory fields, on both endpoints: 200 and the same text as without them
    "store": False,
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
    "prompt_cache_retention": "in-memory",
    "safety_identifier": "s",
    "user": "u",
    "service_tier": "flex",
    "spaces_between_special_tokens": False,
    "stream_options": None,
}
REFUSED = [  # (path, field, value): 400 naming the field, saying why
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "best_of", 2),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "web_search_options", {"search_context_size": "low"}),
    ("/v1/chat/completions", "modalities", ["audio"]),
    ("/v1/completions", "structured_outputs", {"json": {}, "whitespace_pattern": " "}),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_advisory_fields_over_raw_http(http, base_name, path):  # noqa: F811
    body = {"model": base_name, "max_tokens": 4, "temperature": 0}
    body |= {"prompt": PROMPTS[1]} if path == "/v1/completions" else {"messages": CHAT}
    status, plain = post(http, path, body)
    status_advised, advised = post(http, path, {**body, **ACCEPTED})
    assert status == status_advised == 200, advised
    key = "text" if path == "/v1/completions" else "message"
    assert advised["choices"][0][key] == plain["choices"][0][key]
    assert advised["service_tier"] == "default" and "service_tier" not in plain


@pytest.mark.parametrize(("path", "field", "value"), REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_fields_over_raw_http(http, base_name, path, field, value):  # noqa: F811
    body = {"model": base_name, "max_tokens": 2, field: value}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    status, err = post(http, path, body)
    assert status == 400 and err["error"]["param"].startswith(field), err
    assert "not available" in err["error"]["message"] or "not supported" in err["error"]["message"], err
