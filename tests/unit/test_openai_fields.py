"""Every request field of docs/operations.md's table, at the door's translation (no server): what
reaches the GenerateRequest, what shapes the answer, what is refused and why."""

from __future__ import annotations

import json

import pytest

from loraplex.services.openai import chat_schema, completion_schema, reply, schema
from loraplex.services.openai.errors import OpenAIError

USER = [{"role": "user", "content": "hi"}]


def _chat(**body):
    req, legacy = chat_schema.parse_chat({"model": "m", "messages": USER, **body})
    return chat_schema.chat_call(req, "", 0, legacy)


def _completion(**body):
    return completion_schema.completion_call(
        schema.parse(completion_schema.CompletionRequest, {"model": "m", "prompt": "hi", **body}), ""
    )


def _refused(call, param: str, words: str, **body) -> None:
    with pytest.raises(OpenAIError) as info:
        call(**body)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message, info.value


def test_advisory_fields_are_accepted_and_change_nothing():
    plain = _chat().request
    advisory = _chat(
        store=False,
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        safety_identifier="u-1",
        user="u",
        metadata={"a": "b"},
        service_tier="auto",
        modalities=["text"],
        prediction={"type": "content", "content": "hi there"},
        spaces_between_special_tokens=True,
        guided_decoding_backend="xgrammar",
        stream_options=None,
    )
    assert advisory.request == plain
    assert advisory.reply.service_tier == "default"
    assert _chat(store=True).request == plain  # nothing is stored either way
    completion = _completion(user="u", store=False, metadata={"a": "b"}, service_tier="default").request
    assert completion == _completion().request


def test_sampling_extensions_reach_the_proto():
    call = _completion(
        logit_bias={"50": 2.5, "7": -100},
        allowed_token_ids=[1, 2],
        bad_words=["foo"],
        include_stop_str_in_output=True,
        truncate_prompt_tokens=9,
        priority=-3,
        cache_salt="s",
        response_format={"type": "json_object"},
    )
    p = call.request.sampling_params
    assert dict(p.logit_bias) == {50: 2.5, 7: -100.0} and list(p.allowed_token_ids) == [1, 2]
    assert list(p.bad_words) == ["foo"] and p.include_stop_str_in_output and p.truncate_prompt_tokens == 9
    assert (p.priority, p.cache_salt, p.json_object) == (-3, "s", True)
    assert call.fields == {"sampling_params.json_object": "response_format"}


def test_chat_template_fields_reach_the_input():
    inp = _chat(
        reasoning_effort="low", verbosity="high", chat_template_kwargs={"enable_thinking": False}
    ).request
    kwargs = json.loads(inp.inputs[0].chat_template_kwargs_json)
    assert kwargs == {"reasoning_effort": "low", "verbosity": "high", "enable_thinking": False}
    # the explicit kwargs win over the advisory spelling
    inp = _chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).request
    assert json.loads(inp.inputs[0].chat_template_kwargs_json) == {"reasoning_effort": "high"}
    msgs = [*USER, {"role": "assistant", "content": "Once upon"}]
    inp = _chat(messages=msgs, add_generation_prompt=False, continue_final_message=True).request.inputs[0]
    assert inp.HasField("add_generation_prompt") and not inp.add_generation_prompt
    assert inp.continue_final_message
    _refused(
        _chat, "continue_final_message", "add_generation_prompt", messages=msgs, continue_final_message=True
    )


def test_refusals_say_why():
    _refused(_chat, "modalities", "text only", modalities=["text", "audio"])
    _refused(_chat, "audio", "text only", audio={"voice": "x"})
    _refused(_completion, "suffix", "no insertion", suffix="end")
    _refused(_completion, "best_of", "best_of > n", best_of=3)
    _refused(_completion, "guided_decoding_backend", "xgrammar", guided_decoding_backend="outlines")
    _refused(_completion, "guided_whitespace_pattern", "xgrammar", guided_whitespace_pattern=r"\s*")
    _refused(_completion, "logit_bias", "not a token id", logit_bias={"hello": 1})
    _refused(_completion, "logit_bias", "[-100, 100]", logit_bias={"5": 300})
    _refused(
        _completion,
        "structured_outputs.whitespace_pattern",
        "xgrammar",
        structured_outputs={"json": {}, "whitespace_pattern": " "},
    )


def test_nested_unknown_keys_are_refused_like_top_level_ones():
    _refused(_chat, "stream_options.bogus", "", stream_options={"include_usage": True, "bogus": 1})
    _refused(_chat, "response_format.bogus", "unknown field", response_format={"type": "text", "bogus": 1})
    _refused(
        _chat,
        "response_format.json_schema.bogus",
        "unknown field",
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "bogus": 1}},
    )
    _refused(
        _chat, "messages[0]", "unknown field 'bogus'", messages=[{"role": "user", "content": "x", "bogus": 1}]
    )
    _refused(
        _chat,
        "messages[0].content[0].bogus",
        "",
        messages=[{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}],
    )
    _refused(_chat, "prediction.bogus", "", prediction={"type": "content", "content": "x", "bogus": 1})
    # null is not given, as at the top level (an SDK's message object sent back as it came)
    _chat(messages=[*USER, {"role": "assistant", "content": "x", "audio": None, "function_call": None}])


def test_whitespace_controls():
    loose = _completion(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": False})
    assert loose.request.sampling_params.json_any_whitespace
    compact = _completion(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    assert not compact.request.sampling_params.json_any_whitespace
    _refused(
        _completion,
        "structured_outputs.disable_any_whitespace",
        "JSON outputs only",
        structured_outputs={"regex": "a+", "disable_any_whitespace": False},
    )


def test_functions_travel_as_tools_and_answer_in_their_shape():
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    call = _chat(functions=[fn], function_call={"name": "get_weather"})
    assert (
        call.tool_plan.mode == "named"
        and call.tool_plan.name == "get_weather"
        and call.reply.legacy_functions
    )
    history = [
        *USER,
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    msgs = _chat(functions=[fn], messages=history).request.inputs[0].messages
    assert json.loads(msgs[1].tool_calls_json)[0]["function"]["name"] == "get_weather"
    assert msgs[2].role == "tool" and msgs[2].tool_call_id == json.loads(msgs[1].tool_calls_json)[0]["id"]
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
    }
    out = reply.finish_body(body, call.reply._replace(request_id="abc"))
    choice = out["choices"][0]
    assert (
        choice["message"]["function_call"] == {"name": "f", "arguments": "{}"}
        and "tool_calls" not in choice["message"]
    )
    assert choice["finish_reason"] == "function_call" and out["id"] == "chatcmpl-abc"
    _refused(_chat, "functions", "not both", functions=[fn], tools=[{"type": "function", "function": fn}])


def test_chat_echo_leads_with_the_final_assistant_message():
    msgs = [*USER, {"role": "assistant", "content": "The answer is"}]
    options = _chat(messages=msgs, echo=True, add_generation_prompt=False, continue_final_message=True).reply
    body = {
        "id": "i",
        "object": "chat.completion",
        "choices": [{"message": {"role": "assistant", "content": " 42"}}],
    }
    assert reply.finish_body(body, options)["choices"][0]["message"]["content"] == "The answer is 42"
    assert _chat(echo=True).reply.echo == ""  # the final message is the user's: nothing to echo


def test_add_special_tokens():
    inputs = _completion(prompt=["a", "b"], add_special_tokens=False).request.inputs
    assert all(i.HasField("add_special_tokens") and not i.add_special_tokens for i in inputs)
    assert not _completion().request.inputs[0].HasField("add_special_tokens")  # the tokenizer's default
    assert _chat(add_special_tokens=False).request == _chat().request
    _refused(_chat, "add_special_tokens", "chat template writes", add_special_tokens=True)
