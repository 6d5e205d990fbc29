"""The request fields beyond sampling proper, OpenAI's and vLLM's, -> the GenerateRequest, and the
few that shape the answer (`ReplyOptions`). docs/operations.md keeps the table of every field's
effect; this module is where each one takes it.

- Into SamplingParams: `logit_bias`, `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
  `truncate_prompt_tokens`, `priority`, `cache_salt`.
- Into the chat Input: `chat_template_kwargs` (with `reasoning_effort` / `verbosity` as template
  variables of the same names, for templates that read them), `add_generation_prompt`,
  `continue_final_message`.
- Checked here and refused with the reason: a structured-output backend other than xgrammar, a
  whitespace pattern (xgrammar has none), non-text output.
- Advisory (accepted, nothing to do): `store` (nothing is stored), `prompt_cache_key` /
  `prompt_cache_retention` (the prefix cache is automatic), `user` / `safety_identifier` (labels),
  `prediction` (no speculative decoding here), `spaces_between_special_tokens` (the fast tokenizer's
  own decode joins special tokens, as in vLLM), `metadata` (echoed by the Responses API only, as
  OpenAI does).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from loraplex.services.openai.errors import bad_request
from loraplex.v1 import inference_pb2 as pb

# Structured-output backends a request may name: this server compiles with xgrammar.
BACKENDS = ("xgrammar", "auto")


class ReplyOptions(NamedTuple):
    """What the answer carries beyond the generated output, from the request."""

    request_id: str | None = None  # vLLM's: the answer's id is `<prefix>-<request_id>`
    service_tier: str | None = None  # asked -> answered "default" (one tier here)
    legacy_functions: bool = False  # `functions` asked: answer `function_call`, not `tool_calls`
    echo: str | None = None  # chat echo: the final assistant message's text leads the content
    continuous_usage: bool = False  # a stream's usage on every chunk
    obfuscation: bool = False  # a stream's chunks carry random `obfuscation` padding


def logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}; a key that is no decimal id is a 400 naming it."""
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) > 0xFFFFFFFF:
            raise bad_request(f"logit_bias key {key[:40]!r} is not a token id", "logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias[{key}] is {bias}: a bias is in [-100, 100]", "logit_bias")
        out[int(key)] = bias
    return out


def apply_sampling(req, params: pb.SamplingParams) -> None:
    """The vLLM extensions and logit_bias that travel in SamplingParams."""
    for key, bias in logit_bias(req.logit_bias).items():
        params.logit_bias[key] = bias
    ids = req.allowed_token_ids or []
    if any(t < 0 or t > 0xFFFFFFFF for t in ids):
        raise bad_request("allowed_token_ids must be token ids (non-negative)", "allowed_token_ids")
    params.allowed_token_ids.extend(ids)
    params.bad_words.extend(req.bad_words or [])
    params.include_stop_str_in_output = req.include_stop_str_in_output
    params.truncate_prompt_tokens = req.truncate_prompt_tokens or 0
    params.priority = req.priority
    params.cache_salt = req.cache_salt or ""
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {req.guided_decoding_backend[:40]!r} is not available: this server "
            f"compiles structured outputs with xgrammar (give {' or '.join(BACKENDS)})",
            "guided_decoding_backend",
        )
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not available: xgrammar has no whitespace pattern; "
            "give structured_outputs.disable_any_whitespace (false: any whitespace, true: compact)",
            "guided_whitespace_pattern",
        )


def template_kwargs(req) -> dict[str, Any]:
    """The chat template's extra variables: reasoning_effort / verbosity under their own names (a
    template with such a switch reads them; others ignore them), then chat_template_kwargs."""
    out: dict[str, Any] = {}
    if req.reasoning_effort is not None:
        out["reasoning_effort"] = req.reasoning_effort
    if req.verbosity is not None:
        out["verbosity"] = req.verbosity
    return out | (req.chat_template_kwargs or {})


def apply_chat(req, inp: pb.Input) -> None:
    if req.add_special_tokens:
        raise bad_request(
            "add_special_tokens true is not available on chat: the chat template writes the special "
            "tokens (send false, the default)",
            "add_special_tokens",
        )
    other = [m for m in req.modalities or [] if m != "text"]
    if other:
        raise bad_request(
            f"modalities {other[0][:20]!r} is not available: this server generates text only", "modalities"
        )
    kwargs = template_kwargs(req)
    if kwargs:
        inp.chat_template_kwargs_json = json.dumps(kwargs)
    if not req.add_generation_prompt:
        inp.add_generation_prompt = False
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request(
                "continue_final_message needs add_generation_prompt: false", "continue_final_message"
            )
        if req.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message continues the final message: it must be the assistant's",
                "continue_final_message",
            )
        inp.continue_final_message = True


def chat_echo(req) -> str | None:
    """vLLM's echo on chat: the final message's text when it is the assistant's (the answer's role)."""
    if not req.echo:
        return None
    last = req.messages[-1]
    if last.role != "assistant":
        return ""
    content = last.content
    return content if isinstance(content, str) else "".join(p.text for p in content or [])


def reply_options(req, chat: bool, legacy_functions: bool = False) -> ReplyOptions:
    stream = req.stream_options
    return ReplyOptions(
        request_id=req.request_id,
        service_tier="default" if req.service_tier is not None else None,
        legacy_functions=legacy_functions,
        echo=chat_echo(req) if chat else None,
        continuous_usage=bool(stream and stream.continuous_usage_stats),
        obfuscation=bool(stream and stream.include_obfuscation),
    )
