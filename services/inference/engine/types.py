"""Plain data crossing the engine API: sampling parameters in, outputs and info out."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from loraplex.services.inference.errors import InvalidRequest

# Alternatives per position a request may ask for (OpenAI's bound for top_logprobs).
MAX_TOP_LOGPROBS = 20
# repetition_penalty divides positive logits and multiplies negative ones: 1e-38 overflows float32
# logits to inf (NaN after the softmax, then token 0 or garbage), 1e38 to -inf. These bounds keep
# every penalised logit finite in float32 and float16/bfloat16 alike (|logit| stays below 1e4
# times its size) and are far past any useful penalty (transformers suggests 1.0-1.5).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _within(value: float, low: float, high: float) -> bool:
    """low <= value <= high, where a bound the wire's float32 cannot hold exactly (0.01 arrives as
    0.0099999998) still admits its float32 neighbour."""
    slack = 1e-7  # above float32's relative rounding (6e-8)
    return low * (1 - slack) <= value <= high * (1 + slack)


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# A grammar's text (schema JSON, regex, EBNF, or all choices together) may be this long at most:
# compile time grows with it, and a caller who needs more is better served by a smaller grammar.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 1024
# OpenAI's bounds for logit_bias: at most this many entries, each bias in [-100, 100].
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 256


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (engine/grammar.py compiles it, the sampler masks by it).

    kind: "json_schema" (value: the schema as JSON text), "json_object" (any JSON object; no value),
    "regex" (value: a pattern the whole output matches), "choice" (choices: one of these strings,
    exactly) or "grammar" (value: EBNF in xgrammar's GBNF dialect, start rule `root`)."""

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()
    # JSON kinds: any whitespace between tokens instead of the compact form (xgrammar's any_whitespace).
    any_whitespace: bool = False

    @property
    def field(self) -> str:
        return f"sampling_params.{self.kind}"

    def validate(self) -> None:
        """The checks that need no compiler: a known kind, a value where one is needed, size limits."""
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(
                f"unknown constraint kind {self.kind!r}; one of {', '.join(CONSTRAINT_KINDS)}",
                field="sampling_params.constraint",
            )
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidRequest(
                    f"{self.field} needs 1-{MAX_CHOICES} strings (got {len(self.choices)})", field=self.field
                )
            if any(not c for c in self.choices):
                raise InvalidRequest(f"{self.field} has an empty string", field=self.field)
            size = sum(len(c) for c in self.choices)
        else:
            if self.kind != "json_object" and not self.value:
                raise InvalidRequest(f"{self.field} is empty", field=self.field)
            size = len(self.value)
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(
                f"{self.field} is {size} characters; at most {MAX_CONSTRAINT_CHARS}", field=self.field
            )
        if self.kind == "json_schema":
            self._check_schema_text()

    def _check_schema_text(self) -> None:
        """JSON that is no schema object ("1e999", "[1]") would reach the compiler, whose refusal of
        it has no text: say why here."""
        try:
            schema = json.loads(self.value)
        except (ValueError, RecursionError):
            return  # not JSON: the compile step says where it breaks
        if not isinstance(schema, dict):
            got = _JSON_KINDS.get(type(schema), "no object")
            raise InvalidRequest(
                f"{self.field} must be a JSON schema (an object); got {got}", field=self.field
            )


_JSON_KINDS = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    type(None): "null",
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; defaults mean "off". temperature 0 = greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # None = no log probabilities; k >= 0 = the sampled token's and the k most likely tokens'.
    logprobs: int | None = None
    # The same for each prompt token after the first.
    prompt_logprobs: int | None = None
    # Constrained decoding: the output must match this (None = free text).
    constraint: Constraint | None = None
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # EOS (unless ignore_eos) and stop_token_ids are masked out of sampling before this many new tokens.
    min_tokens: int = 0
    # (token id, bias) added to the row's logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Non-empty: only these ids can be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: tuple[int, ...] = ()
    # Token sequences that must not be generated: the last id is masked when the output ends with
    # the others (vLLM's bad_words, tokenized by the servicer).
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) stays
    priority: int = 0  # lower is admitted first among waiting requests; ties keep arrival order
    cache_salt: str = ""  # prefix-cache reuse only between requests of the same salt

    @property
    def masks_tokens(self) -> bool:
        """Whether sampling adds a per-row bias or mask for this request."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_ids)

    def check_token_ids(self, vocab_size: int) -> None:
        """The ids the caller gave for biasing and masking exist in the vocabulary."""
        for name, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("allowed_token_ids", self.allowed_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"sampling_params.{name} has token id {bad[0]}: ids must be in [0, {vocab_size})",
                    field=f"sampling_params.{name}",
                )

    def _validate_masks(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"sampling_params.logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                field="sampling_params.logit_bias",
            )
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and low <= bias <= high):
                raise InvalidRequest(
                    f"sampling_params.logit_bias[{token}] is {bias}: a bias is in [{low:g}, {high:g}]",
                    field="sampling_params.logit_bias",
                )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequest(
                f"sampling_params.allowed_token_ids has {len(self.allowed_token_ids)} entries",
                field="sampling_params.allowed_token_ids",
            )

    def validate(self, max_new_tokens_limit: int | None = None) -> None:
        """Raise InvalidRequest naming the field when a value is out of range."""
        self._validate_masks()
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequest(
                    f"sampling_params.{name} must be a finite number", field=f"sampling_params.{name}"
                )
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_new_tokens, "must be in [0, max_new_tokens]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "repetition_penalty",
                _within(self.repetition_penalty, *REPETITION_PENALTY_RANGE),
                f"must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]:g}] (1 = off)",
            ),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            (
                "top_logprobs",
                all(k is None or 0 <= k <= MAX_TOP_LOGPROBS for k in (self.logprobs, self.prompt_logprobs)),
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                got = (self.logprobs, self.prompt_logprobs) if name == "top_logprobs" else getattr(self, name)
                raise InvalidRequest(
                    f"sampling_params.{name} {why} (got {got})", field=f"sampling_params.{name}"
                )
        if self.constraint is not None:
            self.constraint.validate()
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens {self.max_new_tokens} exceeds this server's limit "
                f"{max_new_tokens_limit}",
                field="sampling_params.max_new_tokens",
            )


class TokenLogprob(NamedTuple):
    """A chosen token's log probability and the most likely alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestOutput(NamedTuple):
    """One increment of one request's output. The last one has `finished=True`."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int
    # One per new token id when the request asked for log probabilities, else None.
    logprobs: list[TokenLogprob] | None = None
    # Seconds from arrival to first admission, and from arrival to the first token (0 = not yet).
    queue_time: float = 0.0
    time_to_first_token: float = 0.0
    # Prompt tokens whose KV came from a cache rather than a forward (0 without a prefix cache).
    cached_prompt_tokens: int = 0
    # With params.prompt_logprobs: one per prompt token after the first, on the output that
    # carries the first generated token.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ModelInfo:
    model: str
    dtype: str
    device: str
    max_loras_per_batch: int
    max_lora_rank: int
    lora_target_modules: list[str] = field(default_factory=list)
    lora_backend: str = "torch"
    tp_size: int = 1
    context_length: int = 0
    architecture: str = ""  # config.json's, e.g. Gemma2ForCausalLM
    family: str = ""  # models/families.py name, e.g. gemma2


class EngineStats(NamedTuple):
    """A snapshot for metrics and tests (e.g. KV blocks freed after a cancel)."""

    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    lora_slots_total: int
    lora_slots_used: int
    lora_slots_draining: int = 0  # busy slots taking no new requests until they empty for a waiting adapter
    lora_adapters_waiting: int = 0  # adapters waiting for a slot
    lora_suspensions: int = 0  # running requests that gave their slot up so far (cumulative)
    lora_requests_suspended: int = 0  # requests holding KV but no slot now
    # Prefix cache: registered blocks (held or evictable; evictable ones also count as free),
    # cached blocks evicted for room so far, and per adapter ("" = base) the prompt tokens of
    # first admissions and how many of them were reused from the cache.
    prefix_cache_enabled: bool = False
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_prompt_tokens: dict[str, int] = {}  # noqa: RUF012 - never mutated; each snapshot has its own
    prefix_cache_hit_tokens: dict[str, int] = {}  # noqa: RUF012
    # Speculative decoding, per adapter ("" = base): draft tokens verified, and how many were accepted.
    spec_draft_tokens: dict[str, int] = {}  # noqa: RUF012
    spec_accepted_tokens: dict[str, int] = {}  # noqa: RUF012
