"""Streamed echo and prompt_logprobs (services/openai/stream.py): the chunks a stream gives, added up
choice by choice, equal the non-streaming body built from the same engine outputs (no server needed;
the real door is tests/integration/test_openai_door_stream.py)."""

from __future__ import annotations

from typing import Any

from loraplex.services.openai import chat_schema, completion_schema, responses, schema
from loraplex.services.openai.stream import StreamState
from loraplex.v1 import inference_pb2 as pb

# "I feel 😀" with the emoji split over two byte-level tokens, then " today" generated in two.
PROMPT = [b"I", b" feel", b" \xf0\x9f", b"\x98\x80"]
OUTPUT = [b" to", b"day"]


def _lp(i: int, b: bytes) -> pb.TokenLogprob:
    top = [
        pb.TopLogprob(token_id=i, logprob=-0.5 * i, token_bytes=b),
        pb.TopLogprob(token_id=99, logprob=-9.0),
    ]
    return pb.TokenLogprob(token_id=i, logprob=-0.5 * i, token_bytes=b, top=top)


def _completion(index: int, sample: int, score_only: bool = False) -> pb.Completion:
    out = OUTPUT[:1] if score_only else OUTPUT  # scoring: the engine generates one token all the same
    return pb.Completion(
        index=index,
        sample=sample,
        text=b"".join(out).decode(),
        finish_reason="length",
        prompt_tokens=len(PROMPT),
        completion_tokens=len(out),
        logprobs=[_lp(10 + j, b) for j, b in enumerate(out)],
        prompt_logprobs=[_lp(j, b) for j, b in enumerate(PROMPT[1:], 1)],
        prompt_first_token_bytes=PROMPT[0],
    )


def _messages(c: pb.Completion) -> list[pb.GenerateStreamResponse]:
    """The stream of `c`, as the server sends it: a token a message, the prompt's log probabilities
    with the first, the finish and counts with the last."""
    msgs = []
    for j, lp in enumerate(c.logprobs):
        msg = pb.GenerateStreamResponse(
            index=c.index,
            sample=c.sample,
            text=lp.token_bytes.decode(),
            logprobs=[lp],
            token_ids=[lp.token_id],
        )
        if j == 0:
            msg.prompt_logprobs.extend(c.prompt_logprobs)
            msg.prompt_first_token_bytes = c.prompt_first_token_bytes
        msgs.append(msg)
    last = msgs[-1]
    last.finish_reason, last.prompt_tokens, last.completion_tokens = (
        "length",
        c.prompt_tokens,
        len(c.logprobs),
    )
    return msgs


def _both(body: dict[str, Any], n: int = 1, prompts: int = 1, score_only: bool = False, chat: bool = False):
    """The body and the stream's chunks for `prompts` inputs of `n` samples each, the streams of the
    choices interleaved message by message, as the server's are."""
    req = schema.parse(
        chat_schema.ChatRequest if chat else completion_schema.CompletionRequest,
        {"model": "m", "n": n, **body},
    )
    door = chat_schema.chat_call(req, "") if chat else completion_schema.completion_call(req, "")
    outputs = [_completion(i, s, score_only) for i in range(prompts) for s in range(n)]
    resp = pb.GenerateResponse(completions=outputs)
    whole = (responses.chat_body if chat else responses.completion_body)(resp, "m", door.asked)
    state = StreamState("m", n, chat, door.asked)
    streams = [_messages(c) for c in outputs]
    chunks = [ch for step in range(2) for s in streams if step < len(s) for ch in state.chunks(s[step])]
    return whole, chunks, state


def _choices(chunks, k: int) -> list[dict[str, Any]]:
    return [c for ch in chunks for c in ch["choices"] if c["index"] == k]


def _added_up(parts: list[dict[str, Any]]) -> tuple[str, dict[str, list] | None]:
    text = "".join(p["text"] for p in parts)
    if parts[0]["logprobs"] is None:
        return text, None
    lists = {name: [x for p in parts for x in p["logprobs"][name]] for name in parts[0]["logprobs"]}
    return text, lists


def test_echo_stream_adds_up_to_the_body_for_every_choice():
    """Two prompts, two samples each: four choices, each led by the prompt and its log probabilities."""
    prompt = b"".join(PROMPT).decode()
    whole, chunks, _ = _both({"prompt": [prompt, prompt], "echo": True, "logprobs": 1}, n=2, prompts=2)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for want in whole["choices"]:
        parts = _choices(chunks, want["index"])
        assert parts[0]["text"] == prompt and parts[0]["finish_reason"] is None  # the prompt leads, alone
        assert parts[0]["logprobs"]["token_logprobs"][0] is None
        assert len(parts[0]["logprobs"]["tokens"]) == len(PROMPT)
        assert _added_up(parts) == (want["text"], want["logprobs"])
        assert parts[-1]["finish_reason"] == want["finish_reason"] == "length"
    assert whole["choices"][0]["logprobs"]["tokens"][2:4] == ["bytes: \\xf0\\x9f", "bytes:\\x98\\x80"]


def test_echo_of_token_ids_streams_the_decoded_prompt():
    ids = list(range(len(PROMPT)))
    whole, chunks, _ = _both({"prompt": ids, "echo": True})
    parts = _choices(chunks, 0)
    assert parts[0] == {"index": 0, "text": "I feel 😀", "logprobs": None, "finish_reason": None}
    assert _added_up(parts)[0] == whole["choices"][0]["text"] == "I feel 😀 today"


def test_scoring_stream_is_the_prompt_then_the_finish():
    whole, chunks, state = _both(
        {"prompt": [[1, 2, 3, 4]], "echo": True, "logprobs": 0, "max_tokens": 0}, score_only=True
    )
    parts = _choices(chunks, 0)
    assert len(parts) == 2 and parts[1]["text"] == "" and parts[1]["finish_reason"] == "length"
    assert parts[1]["logprobs"]["tokens"] == []  # the one token the engine generated is left out
    assert _added_up(parts) == (whole["choices"][0]["text"], whole["choices"][0]["logprobs"])
    assert state.usage_chunk()["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_lead_each_completion_choice_once():
    whole, chunks, _ = _both({"prompt": "I feel 😀", "prompt_logprobs": 1, "logprobs": 1}, n=2)
    for want in whole["choices"]:
        parts = _choices(chunks, want["index"])
        assert parts[0]["prompt_logprobs"] == want["prompt_logprobs"]
        assert parts[0]["prompt_logprobs"][0] is None and len(parts[0]["prompt_logprobs"]) == len(PROMPT)
        assert all("prompt_logprobs" not in p for p in parts[1:])
        assert _added_up(parts) == (want["text"], want["logprobs"])
    # with echo, on the prompt's chunk
    whole, chunks, _ = _both({"prompt": "I feel 😀", "prompt_logprobs": 0, "echo": True})
    parts = _choices(chunks, 0)
    assert (
        parts[0]["text"] == "I feel 😀"
        and parts[0]["prompt_logprobs"] == whole["choices"][0]["prompt_logprobs"]
    )


def test_prompt_logprobs_lead_even_when_the_first_token_has_no_text_yet():
    """A first token whose text the server holds back (half a character, a possible stop string)
    still brings the prompt's log probabilities: they get a chunk of their own."""
    state = StreamState("m", 1, False, responses.Asked(prompt_logprobs=0))
    msg = _messages(_completion(0, 0))[0]
    msg.text = ""
    (chunk,) = state.chunks(msg)
    assert chunk["choices"][0]["text"] == "" and len(chunk["choices"][0]["prompt_logprobs"]) == len(PROMPT)


def test_chat_prompt_logprobs_ride_on_each_choice_role_chunk():
    messages = [{"role": "user", "content": "hi"}]
    whole, chunks, _ = _both({"messages": messages, "prompt_logprobs": 2}, n=2, chat=True)
    leads = [ch for ch in chunks if "prompt_logprobs" in ch]
    assert [ch["choices"][0]["index"] for ch in leads] == [0, 1]
    assert all(ch["choices"][0]["delta"]["role"] == "assistant" for ch in leads)
    assert all(ch["prompt_logprobs"] == whole["prompt_logprobs"] for ch in leads)
