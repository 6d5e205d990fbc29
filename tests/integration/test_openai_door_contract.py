"""The door's contract with evaluation harnesses and SDKs, through the unchanged `openai` package
over the shared SmolLM2 server (prefix cache on, its default): echo scoring equal to gRPC's prompt
log probabilities, every field honoured or refused, OpenAI's error shape on every path."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_openai_door import CHAT, LOGPROB_TOL, base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import PROMPTS, adapters, server, stub  # noqa: F401


def raw(door, method: str, path: str, body: dict | None = None):  # noqa: F811
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://{door.address}{path}", data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def grpc_prompt_logprobs(stub, ids: list[int], adapter: str) -> pb.Completion:  # noqa: F811
    params = pb.SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True, top_logprobs=1)
    req = pb.GenerateRequest(inputs=[pb.Input(token_ids=ids)], adapter=[adapter], sampling_params=params)
    return stub.Generate(req).completions[0]


def test_models_retrieve(client, base_name):  # noqa: F811
    assert client.models.retrieve(base_name).id == base_name
    alpha = client.models.retrieve("alpha")
    assert alpha.id == "alpha" and alpha.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("model", ["base", "alpha"])
def test_echo_scoring_equals_grpc_prompt_logprobs(client, stub, base_name, model):  # noqa: F811
    """lm-eval's loglikelihood request, batched, token ids, pure scoring (max_tokens 0) and with one
    generated token; the prefix cache holds these prompts' blocks from the earlier calls."""
    name, adapter = (base_name, "") if model == "base" else ("alpha", "alpha")
    prompts = [list(stub.Tokenize(pb.TokenizeRequest(text=p)).token_ids) for p in PROMPTS[:2]]
    for max_tokens in (0, 1):
        resp = client.completions.create(
            model=name, prompt=prompts, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0, seed=1
        )
        choices = sorted(resp.choices, key=lambda c: c.index)
        assert len(choices) == len(prompts)
        for text, ids, choice in zip(PROMPTS, prompts, choices, strict=False):
            want = grpc_prompt_logprobs(stub, ids, adapter)
            got = choice.logprobs
            assert len(got.tokens) == len(ids) + max_tokens
            assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
            assert got.token_logprobs[1 : len(ids)] == pytest.approx(
                [lp.logprob for lp in want.prompt_logprobs], abs=LOGPROB_TOL
            )
            prompt_text = "".join(got.tokens[: len(ids)])  # SmolLM2's tokens are whole characters here
            assert choice.text.startswith(prompt_text) and prompt_text == text
            assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0
            for i, t in enumerate(got.tokens[: len(ids)]):
                assert choice.text[got.text_offset[i] :].startswith(t)
            if max_tokens == 0:
                assert choice.text == prompt_text and choice.finish_reason == "length"
        assert resp.usage.completion_tokens == (0 if max_tokens == 0 else len(prompts))
        assert resp.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_echo_text_prompt_and_byte_tokens(client, base_name):  # noqa: F811
    prompt = "I feel 😀 today"
    resp = client.completions.create(
        model=base_name, prompt=prompt, max_tokens=2, logprobs=2, echo=True, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    tokens = choice.logprobs.tokens
    assert any(t.startswith("bytes:") for t in tokens)  # the emoji's pieces keep their bytes
    assert "\ufffd" not in "".join(tokens)
    assert choice.text[choice.logprobs.text_offset[-2] :].startswith(tokens[-2])


def test_cached_tokens_in_usage(client, base_name):  # noqa: F811
    prompt = "Caching check: " + " ".join(f"word{i}" for i in range(60))
    client.completions.create(model=base_name, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=base_name, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(
        model=base_name, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    assert len(scored.choices[0].logprobs.tokens) == again.usage.prompt_tokens  # complete, cache or not


def test_vllm_extensions_honoured(client, stub, base_name):  # noqa: F811
    kw = dict(model=base_name, messages=CHAT, max_tokens=40, temperature=0)
    natural = client.chat.completions.create(**kw)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 40
    n = natural.usage.completion_tokens
    forced = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 40 and forced.choices[0].finish_reason == "length"
    longer = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    assert longer.choices[0].message.content.startswith(natural.choices[0].message.content.rstrip("."))
    sampled_k1 = client.chat.completions.create(
        **{**kw, "temperature": 1.0}, seed=5, extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0}
    )
    assert sampled_k1.choices[0].message.content == natural.choices[0].message.content
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=natural.choices[0].message.content)).token_ids)
    stopped = client.chat.completions.create(**kw, extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.usage.completion_tokens == 3 and stopped.choices[0].finish_reason == "stop"
    # past an ignored EOS the model writes chat markup: kept only when asked
    special = client.chat.completions.create(
        **kw, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert "<|im_" in special.choices[0].message.content
    assert "<|im_" not in forced.choices[0].message.content
    resp = client.completions.create(
        model=base_name, prompt=PROMPTS[1], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == resp.usage.prompt_tokens and all(len(e) >= 2 for e in plp[1:])


def test_unknown_fields_and_errors_in_openai_shape(client, door, base_name):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt="hi", max_tokens=2, extra_body={"foo_bar": 1})
    assert info.value.param == "foo_bar"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=base_name, messages=CHAT, max_tokens=2, extra_body={"best_of": 2}
        )
    assert info.value.param == "best_of"
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        code, body = raw(door, method, path)
        assert code == status and set(body["error"]) == {"message", "type", "param", "code"}, body
    long_prompt = "hello " * 600  # the server's context is 512 tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt=long_prompt, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "maximum context length is 512 tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=base_name, messages=[{"role": "user", "content": long_prompt}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:  # refused by its length before tokenizing
        client.completions.create(model=base_name, prompt="x" * (512 * 64 + 10), max_tokens=2)
    assert info.value.code == "context_length_exceeded" and "more than 512 tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=base_name, prompt=[1, 2, 10**8], max_tokens=2)
    assert info.value.param == "prompt"


def test_grpc_token_bytes_rebuild_the_prompt(stub):  # noqa: F811
    """Issue 32 item 9: each token's raw bytes travel in the proto (an emoji's pieces are not U+FFFD)."""
    text = "I feel 😀 today"
    params = pb.SamplingParams(max_new_tokens=1, prompt_logprobs=True, top_logprobs=3)
    c = stub.Generate(pb.GenerateRequest(text=[text], sampling_params=params)).completions[0]
    rebuilt = c.prompt_first_token_bytes + b"".join(lp.token_bytes for lp in c.prompt_logprobs)
    assert rebuilt == text.encode()
    assert any(lp.token == "\ufffd" and lp.token_bytes != "\ufffd".encode() for lp in c.prompt_logprobs)
    assert all(t.token_bytes for lp in c.prompt_logprobs for t in lp.top)
