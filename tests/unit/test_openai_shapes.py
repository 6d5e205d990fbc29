"""The door's pure translation pieces: request fields honoured or refused, gRPC fields named as the
request's, log probabilities built from token bytes (no server needed)."""

from __future__ import annotations

import pytest

from loraplex.services.openai import logprobs as lp
from loraplex.services.openai import schema
from loraplex.services.openai.chat_schema import ChatRequest, chat_request
from loraplex.services.openai.completion_schema import CompletionRequest, completion_request
from loraplex.services.openai.errors import OpenAIError, request_param
from loraplex.v1 import inference_pb2 as pb


def _parse(cls, **body):
    return schema.parse(cls, {"model": "m", **body})


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(OpenAIError) as info:
        _parse(CompletionRequest, prompt="hi", foo_bar=1)
    assert info.value.status == 400 and info.value.param == "foo_bar" and "foo_bar" in info.value.message
    with pytest.raises(OpenAIError) as info:
        _parse(ChatRequest, messages=[{"role": "user", "content": "x"}], web_search_options={"a": 1})
    assert info.value.param == "web_search_options" and "web search is not available" in info.value.message
    # OpenAI fields this server lacks pass when empty, as SDKs send them
    _parse(ChatRequest, messages=[{"role": "user", "content": "x"}], audio=None, metadata={})


def test_vllm_extensions_reach_the_sampling_params():
    req = _parse(
        CompletionRequest,
        prompt="hi",
        ignore_eos=True,
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=3,
        stop_token_ids=[7, 9],
        seed=4,
        skip_special_tokens=False,
        prompt_logprobs=2,
        logprobs=1,
    )
    grpc_req, asked = completion_request(req, "")
    p = grpc_req.sampling_params
    assert (p.ignore_eos, p.top_k, p.min_tokens, list(p.stop_token_ids), p.seed) == (True, 0, 3, [7, 9], 4)
    assert p.min_p == pytest.approx(0.1) and p.repetition_penalty == pytest.approx(1.2)
    assert p.HasField("skip_special_tokens") and not p.skip_special_tokens
    assert p.logprobs and p.prompt_logprobs and p.top_logprobs == 2
    assert (asked.logprobs, asked.prompt_logprobs) == (1, 2)
    assert (
        completion_request(_parse(CompletionRequest, prompt="hi", top_k=5), "")[0].sampling_params.top_k == 5
    )


def test_echo_scoring_and_max_tokens_zero():
    req = _parse(CompletionRequest, prompt=[[1, 2, 3], [4, 5]], echo=True, logprobs=1, max_tokens=0)
    grpc_req, asked = completion_request(req, "")
    assert grpc_req.sampling_params.max_new_tokens == 1 and grpc_req.sampling_params.prompt_logprobs
    assert asked.echo and asked.score_only and asked.prompts == (None, None)
    with pytest.raises(OpenAIError) as info:
        completion_request(_parse(CompletionRequest, prompt="hi", max_tokens=0), "")
    assert info.value.param == "max_tokens"
    # streamed as vLLM streams it (services/openai/stream.py): the same request, the same answer pieces
    streamed = completion_request(_parse(CompletionRequest, prompt="hi", echo=True, stream=True), "")
    assert streamed == completion_request(_parse(CompletionRequest, prompt="hi", echo=True), "")


def test_chat_without_max_tokens_asks_the_server_limit():
    req = _parse(ChatRequest, messages=[{"role": "user", "content": "x"}])
    assert chat_request(req, "", 4096)[0].sampling_params.max_new_tokens == 4096
    req = _parse(ChatRequest, messages=[{"role": "user", "content": "x"}], max_tokens=7)
    assert chat_request(req, "", 4096)[0].sampling_params.max_new_tokens == 7


@pytest.mark.parametrize(
    "field, chat, want",
    [
        ("sampling_params.max_new_tokens", False, "max_tokens"),
        ("inputs[0].sampling_params.top_logprobs", False, "logprobs"),
        ("sampling_params.top_logprobs", True, "top_logprobs"),
        ("inputs[0]", False, "prompt"),
        ("inputs[3]", True, "messages"),
        ("text[1]", False, "prompt"),
        ("inputs[0].messages[2].role", True, "messages[2].role"),
        ("inputs[0].messages[2].tool_calls_json", True, "messages[2].tool_calls"),
        ("inputs[0].tools_json", True, "tools"),
        ("inputs[0].adapter", True, "model"),
        ("sampling_params.temperature", True, "temperature"),
    ],
)
def test_grpc_fields_named_as_the_request(field, chat, want):
    assert request_param(field, chat) == want


def _tok(token_id, b, logprob, top=()):
    return pb.TokenLogprob(
        token_id=token_id,
        token=b.decode("utf-8", errors="replace"),
        token_bytes=b,
        logprob=logprob,
        top=[
            pb.TopLogprob(token_id=i, token=tb.decode("utf-8", errors="replace"), token_bytes=tb, logprob=v)
            for i, tb, v in top
        ],
    )


def test_logprobs_built_from_bytes():
    """An emoji split over two tokens: each keeps its bytes, offsets count characters, and two
    alternatives that decode alone to U+FFFD stay apart."""
    lps = [
        _tok(10, b" \xf0\x9f\x98", -1.0, [(10, b" \xf0\x9f\x98", -1.0), (11, b" \xf0\x9f\x99", -2.0)]),
        _tok(12, b"\x80", -0.5, [(12, b"\x80", -0.5)]),
        _tok(13, b" ok", -0.1),
    ]
    out = lp.legacy(lps, lp.TextOffsets(), 2, first_prompt_token=b"hi")
    assert out["tokens"] == ["hi", "bytes: \\xf0\\x9f\\x98", "bytes:\\x80", " ok"]
    assert out["token_logprobs"] == [None, -1.0, -0.5, pytest.approx(-0.1)]
    assert out["top_logprobs"][0] is None and len(out["top_logprobs"][1]) == 2
    text = "hi 😀 ok"
    assert out["text_offset"] == [0, 2, 3, 4] and text[4:] == " ok"
    chat = lp.chat_logprobs(lps)["content"]
    assert b"".join(bytes(c["bytes"]) for c in chat) == " 😀 ok".encode()
    assert [len(c["top_logprobs"]) for c in chat] == [2, 1, 0]
    plp = lp.prompt_logprobs(lps, 1)
    assert plp[0] is None and plp[1]["10"]["rank"] == 1 and plp[3]["13"]["rank"] is None


def test_draft_adapter_reaches_the_generate_request():
    """extra_body's draft_adapter (loraplex's) is sent as GenerateRequest.draft_adapter on both routes."""
    chat = _parse(ChatRequest, messages=[{"role": "user", "content": "x"}], draft_adapter="d1")
    assert chat_request(chat, "a")[0].draft_adapter == "d1"
    completion = _parse(CompletionRequest, prompt="hi", draft_adapter="d2")
    assert completion_request(completion, "a")[0].draft_adapter == "d2"
    assert completion_request(_parse(CompletionRequest, prompt="hi"), "a")[0].draft_adapter == ""
