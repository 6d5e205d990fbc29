"""Streamed `echo` and `prompt_logprobs` through the unchanged `openai` package over the real door and
the shared SmolLM2 server: greedy, a stream adds up to the non-streaming answer for the same call,
choice by choice (the prompt first, its log probabilities on that choice's first chunk)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_openai_door import CHAT, base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import PROMPTS, adapters, server, stub  # noqa: F401

# One request computed twice (streamed, then not): the same batch shapes, so the values agree to
# rounding at most (test_openai_door.py's 1e-4 covers calls computed beside other work).
TOL = 1e-5
LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _gathered(stream) -> dict[int, dict[str, Any]]:
    """Per choice index: its text and legacy lists added up, its chunks' count, the first chunk's text,
    the prompt_logprobs of each chunk that had them, and the last finish reason."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = out.setdefault(
                c.index, {"text": "", "first": c.text, "chunks": 0, "plp": [], **{n: [] for n in LISTS}}
            )
            got["chunks"] += 1
            got["text"] += c.text
            if c.logprobs is not None:
                for name in LISTS:
                    got[name] += getattr(c.logprobs, name)
            if (c.model_extra or {}).get("prompt_logprobs") is not None:
                got["plp"].append(c.model_extra["prompt_logprobs"])
            got["finish"] = c.finish_reason
    return out


def _same_values(got: list, want: list) -> None:
    """Lists of log probabilities (or of {token: logprob} maps), nulls where the other has them."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, dict):
            assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), abs=TOL)
        else:
            assert (g is None) == (w is None) and (w is None or g == pytest.approx(w, abs=TOL))


def _same_prompt_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        for tid, entry in w.items():
            assert g[tid]["rank"] == entry["rank"] and g[tid]["decoded_token"] == entry["decoded_token"]
            assert g[tid]["logprob"] == pytest.approx(entry["logprob"], abs=TOL)


@pytest.mark.parametrize("max_tokens", [4, 0])
def test_echo_stream_equals_the_answer(client, base_name, max_tokens):  # noqa: F811
    """Two prompts, n=2: four choices, each the prompt first (with its tokens' log probabilities),
    then the generated text; max_tokens 0 (scoring) streams the prompt chunk, then the finish."""
    kw = dict(
        model=base_name, prompt=PROMPTS[:2], max_tokens=max_tokens, echo=True, logprobs=2, n=2, temperature=0
    )
    whole = client.completions.create(**kw)
    streamed = _gathered(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert sorted(streamed) == [c.index for c in whole.choices] == [0, 1, 2, 3]
    for want in whole.choices:
        got = streamed[want.index]
        prompt = PROMPTS[want.index // 2]
        assert got["first"] == prompt and got["text"] == want.text and want.text.startswith(prompt)
        assert got["finish"] == want.finish_reason
        assert got["tokens"] == want.logprobs.tokens and got["text_offset"] == want.logprobs.text_offset
        assert got["token_logprobs"][0] is None
        _same_values(got["token_logprobs"], want.logprobs.token_logprobs)
        _same_values(got["top_logprobs"], want.logprobs.top_logprobs)
        if max_tokens == 0:  # the prompt's chunk and the finish's, nothing generated
            assert got["chunks"] == 2 and got["text"] == prompt and got["finish"] == "length"


def test_echo_stream_usage_counts_as_the_answer(client, base_name):  # noqa: F811
    for max_tokens in (0, 3):
        kw = dict(model=base_name, prompt=PROMPTS[0], max_tokens=max_tokens, echo=True, temperature=0)
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens,
            whole.usage.completion_tokens,
        )
    assert whole.usage.completion_tokens == 3


def test_prompt_logprobs_stream_on_each_choice_first_chunk(client, base_name):  # noqa: F811
    kw = dict(
        model=base_name,
        prompt=PROMPTS[1:3],
        max_tokens=3,
        n=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    whole = client.completions.create(**kw)
    streamed = _gathered(client.completions.create(**kw, stream=True))
    for want in whole.choices:
        got = streamed[want.index]
        assert got["text"] == want.text and len(got["plp"]) == 1  # on the first chunk only
        _same_prompt_logprobs(got["plp"][0], want.model_extra["prompt_logprobs"])
    # with echo too: on the prompt's chunk
    echoed = _gathered(client.completions.create(**kw, echo=True, stream=True))
    assert all(echoed[c.index]["first"] == PROMPTS[1 + c.index // 2] for c in whole.choices)
    _same_prompt_logprobs(echoed[3]["plp"][0], whole.choices[3].model_extra["prompt_logprobs"])


def test_chat_prompt_logprobs_stream(client, base_name):  # noqa: F811
    kw = dict(
        model=base_name, messages=CHAT, max_tokens=3, n=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    leads = [c for c in chunks if (c.model_extra or {}).get("prompt_logprobs") is not None]
    assert sorted(c.choices[0].index for c in leads) == [0, 1]
    assert all(c.choices[0].delta.role == "assistant" for c in leads)
    for lead in leads:
        _same_prompt_logprobs(lead.model_extra["prompt_logprobs"], whole.model_extra["prompt_logprobs"])
    for choice in whole.choices:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == choice.index)
        assert text == choice.message.content
