"""The official `openai` package, unchanged, against `python -m loraplex.services.openai` over a real
inference server (test_service_inference's shared server on the embedded SmolLM2).

Every answer is checked against the gRPC API called directly: the door is a translation, so its
completions, chat answers, streams and log probabilities must equal what Generate gives.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_service_inference import PROMPTS, adapters, server, stub  # noqa: F401
from tests.support.door import running_door

MAX = 6


@pytest.fixture(scope="module")
def door(server):  # noqa: F811
    with running_door(server.address) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(door):
    with openai.OpenAI(base_url=f"http://{door.address}/v1", api_key="EMPTY", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def base_name(client):
    return client.models.list().data[0].id


def grpc_tokens(stub, inp: pb.Input, adapter: str, **params) -> list[pb.Completion]:  # noqa: F811
    req = pb.GenerateRequest(inputs=[inp], adapter=[adapter], sampling_params=pb.SamplingParams(**params))
    return list(stub.Generate(req).completions)


def test_models_lists_base_and_adapters(client, base_name):
    ids = [m.id for m in client.models.list().data]
    assert base_name == "SmolLM2-135M-Instruct" and {"alpha", "beta"} <= set(ids)


@pytest.mark.parametrize("model", ["base", "alpha"])
def test_completions_equal_grpc(client, stub, base_name, model):  # noqa: F811
    name = base_name if model == "base" else model
    adapter = "" if model == "base" else model
    resp = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, logprobs=2)
    want = grpc_tokens(
        stub, pb.Input(text=PROMPTS[0]), adapter, max_new_tokens=MAX, logprobs=True, top_logprobs=2
    )[0]
    choice = resp.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert (
        resp.usage.prompt_tokens == want.prompt_tokens
        and resp.usage.completion_tokens == want.completion_tokens
    )
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=LOGPROB_TOL
    )
    assert [len(t) for t in choice.logprobs.top_logprobs] == [2] * len(want.logprobs)
    assert resp.model == name
    streamed = client.completions.create(
        model=name,
        prompt=PROMPTS[0],
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, reasons, usage = "", [], None
    for chunk in streamed:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            reasons.append(c.finish_reason)
    assert text == want.text and reasons[-1] == want.finish_reason
    assert usage.completion_tokens == want.completion_tokens


def test_completions_batch_of_prompts_and_token_ids(client, stub, base_name):  # noqa: F811
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPTS[1])).token_ids)
    resp = client.completions.create(
        model=base_name, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=MAX, temperature=0, n=2
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=base_name, prompt=ids, max_tokens=MAX, temperature=0)
    assert by_ids.choices[0].text == resp.choices[0].text == resp.choices[1].text


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# The door's call and the direct one are computed apart (the second may reuse the first's KV from the
# prefix cache, or share a batch), so their fp32 logprobs agree to rounding, not bit for bit; 1e-4 is
# the bound the engine's logprobs keep against transformers.
LOGPROB_TOL = 1e-4


@pytest.mark.parametrize("model", ["base", "beta"])
def test_chat_equals_grpc(client, stub, base_name, model):  # noqa: F811
    name = base_name if model == "base" else model
    adapter = "" if model == "base" else model
    want = grpc_tokens(
        stub,
        pb.Input(messages=[pb.ChatMessage(**m) for m in CHAT]),
        adapter,
        max_new_tokens=MAX,
        logprobs=True,
        top_logprobs=1,
    )[0]
    resp = client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=MAX, temperature=0, logprobs=True, top_logprobs=1
    )
    msg = resp.choices[0]
    assert msg.message.role == "assistant" and msg.message.content == want.text
    assert [t.logprob for t in msg.logprobs.content] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=LOGPROB_TOL
    )
    assert [t.token for t in msg.logprobs.content] == [lp.token for lp in want.logprobs]
    assert resp.usage.prompt_tokens == want.prompt_tokens
    stream = client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=MAX, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_seeded_sampling_and_n(client, base_name):
    kw = dict(model=base_name, messages=CHAT, max_tokens=MAX, temperature=1.0, seed=3, n=2)
    one = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in one.choices] == [c.message.content for c in again.choices]
    assert [c.index for c in one.choices] == [0, 1]


def test_errors_in_openai_shape(client, door, base_name):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-adapter", messages=CHAT, max_tokens=2)
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="../bad", prompt="hi", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt="hi", max_tokens=2, temperature=5)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt="hi", max_tokens=5000)
    assert info.value.param == "max_tokens" and "max_tokens 5000" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=base_name,
            messages=CHAT,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert info.value.param == "tool_choice"
    request = urllib.request.Request(
        f"http://{door.address}/v1/completions",
        data=b"{not json",
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(request, timeout=10)
    assert raw.value.code == 400 and "error" in json.loads(raw.value.read())


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_status_mapping(code, status):
    """gRPC statuses the door cannot easily provoke on the shared server (a full queue, a server
    going away) map to OpenAI's HTTP statuses; the JSON keeps OpenAI's error shape."""
    from loraplex.services.openai.errors import from_grpc

    class Failed(grpc.RpcError):
        def code(self):
            return code

        def details(self):
            return "why"

        def trailing_metadata(self):
            return ()

    response = from_grpc(Failed(), "m").response()
    assert response.status_code == status
    assert set(json.loads(response.body)["error"]) == {"message", "type", "param", "code"}
