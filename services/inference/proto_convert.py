"""Proto ⇄ engine types for the Inference servicer (proto zeros mean "server default" / "off").

Also the bounds of every request field the engine does not check itself: counts and lengths
of stop strings / stop ids, adapter names (the store's rule: no path can hide in one), and
the length of LoadAdapter's source and revision.
"""

from __future__ import annotations

import re

from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.types import (
    MAX_BAD_WORDS,
    Constraint,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.lora.names import ADAPTER_NAME_RULE, is_adapter_name
from loraplex.services.inference.server_args import ServerArgs
from loraplex.v1 import inference_pb2 as pb

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SOURCE_CHARS = 4096
MAX_REVISION_CHARS = 256
# No token of a real vocabulary is this long: a longer text cannot fit the context, so it is
# refused before the tokenizer spends seconds on megabytes.
MAX_CHARS_PER_TOKEN = 64
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

LOCATION = {
    "gpu": pb.ADAPTER_LOCATION_GPU,
    "host": pb.ADAPTER_LOCATION_HOST,
    "store": pb.ADAPTER_LOCATION_STORE,
}


def check_adapter_name(name: str, field: str = "name") -> str:
    if not is_adapter_name(name):
        raise InvalidRequest(f"adapter name {name[:160]!r} is invalid: {ADAPTER_NAME_RULE}", field=field)
    return name


def check_source(source: str, revision: str) -> None:
    """LoadAdapter's source and revision: bounded, printable (the resolver checks where a path points)."""
    if not source:
        raise InvalidRequest("source must not be empty", field="source")
    for field, value, limit in (
        ("source", source, MAX_SOURCE_CHARS),
        ("revision", revision, MAX_REVISION_CHARS),
    ):
        if len(value) > limit:
            raise InvalidRequest(
                f"{field} is {len(value)} characters; at most {limit} are accepted", field=field
            )
        if _CONTROL.search(value):
            raise InvalidRequest(f"{field} contains control characters", field=field)


def _check_stops(p: pb.SamplingParams) -> None:
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling_params.stop has {len(p.stop)} entries; at most {MAX_STOP_STRINGS}",
            field="sampling_params.stop",
        )
    for i, stop in enumerate(p.stop):
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"sampling_params.stop[{i}] must be 1-{MAX_STOP_CHARS} characters (got {len(stop)})",
                field=f"sampling_params.stop[{i}]",
            )
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"sampling_params.stop_token_ids has {len(p.stop_token_ids)} entries; "
            f"at most {MAX_STOP_TOKEN_IDS}",
            field="sampling_params.stop_token_ids",
        )


def _constraint(p: pb.SamplingParams) -> Constraint | None:
    """The `constraint` oneof as the engine's Constraint (the engine checks and compiles it)."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        if p.json_any_whitespace:
            raise InvalidRequest(
                "sampling_params.json_any_whitespace applies to json_schema / json_object only",
                field="sampling_params.json_any_whitespace",
            )
        return None
    if kind == "choice":
        return Constraint("choice", choices=tuple(p.choice.choices))
    if kind == "json_object":
        return Constraint("json_object", any_whitespace=p.json_any_whitespace)
    if p.json_any_whitespace and kind != "json_schema":
        raise InvalidRequest(
            f"sampling_params.json_any_whitespace applies to json_schema / json_object, not {kind}",
            field="sampling_params.json_any_whitespace",
        )
    return Constraint(kind, getattr(p, kind), any_whitespace=p.json_any_whitespace)


def to_engine_params(p: pb.SamplingParams, args: ServerArgs) -> SamplingParams:
    """Proto → engine; proto zeros mean 'server default' / 'off'. Checks what only the proto
    shows (stop string sizes, top_logprobs without logprobs); the engine checks the ranges."""
    _check_stops(p)
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens or args.default_max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        logprobs=p.top_logprobs if p.logprobs else None,
        prompt_logprobs=p.top_logprobs if p.prompt_logprobs else None,
        constraint=_constraint(p),
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        min_tokens=p.min_tokens,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        allowed_token_ids=tuple(p.allowed_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        priority=p.priority,
        cache_salt=p.cache_salt,
    )  # bad_words are tokenized with the prompt (generate_inputs.py), truncate_prompt_tokens applied there
    if len(p.bad_words) > MAX_BAD_WORDS or any(not w or len(w) > MAX_STOP_CHARS for w in p.bad_words):
        raise InvalidRequest(
            f"sampling_params.bad_words must be at most {MAX_BAD_WORDS} non-empty words of at most "
            f"{MAX_STOP_CHARS} characters",
            field="sampling_params.bad_words",
        )
    if len(p.cache_salt) > MAX_STOP_CHARS:
        raise InvalidRequest(
            f"sampling_params.cache_salt is {len(p.cache_salt)} characters; at most {MAX_STOP_CHARS}",
            field="sampling_params.cache_salt",
        )
    if p.top_logprobs and not (p.logprobs or p.prompt_logprobs):
        raise InvalidRequest(
            "sampling_params.top_logprobs needs sampling_params.logprobs or prompt_logprobs",
            field="sampling_params.top_logprobs",
        )
    return params  # the engine checks the values' ranges (Engine.generate)


def adapters_per_input(request: pb.GenerateRequest) -> list[str]:
    n, adapters = len(request.text), list(request.adapter)
    if not adapters:
        return [""] * n
    if len(adapters) == 1:
        if adapters[0]:
            check_adapter_name(adapters[0], field="adapter[0]")
        return adapters * n
    if len(adapters) != n:
        raise InvalidRequest(
            f"adapter has {len(adapters)} entries for {n} texts; give one per text, one for all, or none",
            field="adapter",
        )
    for i, name in enumerate(adapters):
        if name:
            check_adapter_name(name, field=f"adapter[{i}]")
    return adapters


def adapter_proto(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=info.name,
        rank=info.rank,
        alpha=info.alpha,
        target_modules=list(info.target_modules),
        location=LOCATION.get(info.location, pb.ADAPTER_LOCATION_UNSPECIFIED),
        pinned=info.pinned,
        requests_in_flight=info.requests_in_flight,
        source=info.source,
        digest=info.digest,
        slot=info.slot if info.location == "gpu" else -1,
    )


def logprobs_proto(engine: Engine, logprobs: list[TokenLogprob], adapter: str = "") -> list[pb.TokenLogprob]:
    """Engine log probabilities -> proto, each token with its text (`engine.detokenize_each`, by
    the adapter's tokenizer)."""
    if not logprobs:
        return []
    ids = sorted({lp.token_id for lp in logprobs} | {t for lp in logprobs for t, _ in lp.top})
    text = dict(zip(ids, engine.detokenize_each(ids, adapter or None), strict=True))
    raw = dict(zip(ids, engine.token_bytes(ids, adapter or None), strict=True))
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=text[lp.token_id],
            token_bytes=raw[lp.token_id],
            top=[pb.TopLogprob(token_id=t, logprob=v, token=text[t], token_bytes=raw[t]) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def first_token_bytes(engine: Engine, work) -> bytes:
    """The first prompt token's bytes for a work item asking prompt log probabilities, else b""."""
    if work.params.prompt_logprobs is None:
        return b""
    return engine.token_bytes(work.prompt_ids[:1], work.adapter or None)[0]


def timing_fields(out: RequestOutput) -> dict[str, float | int]:
    """A finished output's timing, as Completion / GenerateStreamResponse fields."""
    return {
        "queue_time_s": out.queue_time,
        "time_to_first_token_s": out.time_to_first_token,
        "cached_prompt_tokens": out.cached_prompt_tokens,
    }
