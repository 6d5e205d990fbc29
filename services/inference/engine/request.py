"""One generation request as the scheduler and engine track it (host-side state only)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from loraplex.services.inference.engine.grammar import GrammarState
from loraplex.services.inference.engine.types import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """`token_ids` is prompt + output so far; `num_computed_tokens` of them are in the KV cache.

    Prefill and decode are the same thing here: each step computes some of the tokens not yet
    in the cache, and when it reaches the end the next token is sampled. A preempted request
    keeps its output and recomputes its KV on readmission (from its cached prefix, when the
    prefix cache is on).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    draft_adapter: str | None = None  # the draft model's adapter (--speculative-draft-lora-paths)
    lora_slot: int = -1  # adapter slot while running; -1 = base model / not acquired / suspended
    # Gave its slot up for another adapter (AdapterSlots.suspend) and keeps its adapter version and
    # KV; it computes again once `resume` hands it a slot, whichever index that is.
    lora_suspended: bool = False
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: Exception | None = None
    generator: torch.Generator | None = None
    max_new_tokens: int = 0  # params.max_new_tokens capped by the context length
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV a cache supplied
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt tokens 1.. so far
    num_preemptions: int = 0
    # Prefix cache (engine/prefix_cache.py): the root key of what computes this request's KV, the
    # chained keys of its full blocks as far as known, and how many leading blocks of block_table
    # were already offered to the cache.
    kv_root: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Constrained decoding (engine/grammar.py): the matcher of params.constraint, else None.
    grammar: GrammarState | None = None
    # Speculative decoding (engine/speculative.py): this step's draft tokens (after token_ids, not in
    # it), the drafted and accepted counts since the last back-off, and the step it drafts again at.
    draft_ids: list[int] = field(default_factory=list)
    # A draft model's distribution q of each draft token ([len(draft_ids), vocab]); None: one-hot.
    draft_probs: torch.Tensor | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_paused_until: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if not self.max_new_tokens:
            self.max_new_tokens = self.params.max_new_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
