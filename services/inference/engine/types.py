"""Plain data crossing the engine API: sampling parameters in, outputs and info out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from services.inference.errors import InvalidRequest


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

    def validate(self, max_new_tokens_limit: int | None = None) -> None:
        """Raise InvalidRequest naming the field when a value is out of range."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequest(f"sampling_params.{name} must be a finite number", field=f"sampling_params.{name}")
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = off)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0 (1 = off)"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(f"sampling_params.{name} {why} (got {getattr(self, name)})", field=f"sampling_params.{name}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens {self.max_new_tokens} exceeds this server's limit {max_new_tokens_limit}",
                field="sampling_params.max_new_tokens",
            )


class RequestOutput(NamedTuple):
    """One increment of one request's output. The last one has `finished=True`."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int


@dataclass
class AdapterInfo:
    """What the engine knows about one adapter (for ListAdapters)."""

    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    location: str  # "gpu" | "host" | "store"
    pinned: bool = False
    requests_in_flight: int = 0
    source: str = ""
    digest: str = ""
    slot: int = -1
    evictions: int = 0  # times this adapter's GPU slot was given to another adapter


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


class EngineStats(NamedTuple):
    """A snapshot for metrics and tests (e.g. KV blocks freed after a cancel)."""

    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    lora_slots_total: int
    lora_slots_used: int
    # Prefix cache: registered blocks (held or evictable; evictable ones also count as free),
    # cached blocks evicted for room so far, and per adapter ("" = base) the prompt tokens of
    # first admissions and how many of them were reused from the cache.
    prefix_cache_enabled: bool = False
    prefix_cache_blocks: int = 0
    prefix_cache_evictions: int = 0
    prefix_cache_prompt_tokens: dict[str, int] = {}  # noqa: RUF012 - never mutated; each snapshot has its own
    prefix_cache_hit_tokens: dict[str, int] = {}  # noqa: RUF012
