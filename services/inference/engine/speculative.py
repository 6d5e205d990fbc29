"""Speculative decoding: draft a few tokens cheaply, verify them in one target step. This module
drafts (and decides when to); engine/speculative_verify.py verifies.

Drafting (`--speculative-algorithm ngram`, prompt lookup): the draft for a request is what followed
the most recent earlier occurrence of its last n tokens (n from `NGRAM_MAX` down to `NGRAM_MIN`)
in its own prompt and output. It costs no model and no adapter: each request's draft follows what
its own adapter has written so far. With `--speculative-algorithm draft` a smaller model with the
target's tokenizer drafts instead (engine/draft_runner.py): K batched decode steps of its own, a
greedy request drafting its argmax and a sampled one sampling from the draft's distribution q.

Back-off (`Speculator.speculates`, `draft`): no speculation in a step where more than
`disable_batch_size` requests are running (verification then costs more compute than the steps it
saves), nor for `QUIET_STEPS` steps after one where no request found a draft (a drafting step gives
up overlap scheduling, the others keep it); per request,
after `BACKOFF_MIN_DRAFTED` drafted tokens, a request whose acceptance rate stays below
`BACKOFF_RATE` drafts nothing for `BACKOFF_STEPS` steps, then tries again.

Requests that need the sampling of one token at a time keep it (no draft): constrained ones (the
grammar would have to advance through the draft), penalized ones (the penalty reads the history
each position changes) and ones still short of `min_tokens`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.services.inference.engine.draft_runner import DraftRunner
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import SamplingInputs
from loraplex.services.inference.engine.speculative_verify import Verified

NGRAM_MAX = 4  # longest suffix looked up
NGRAM_MIN = 1  # shortest
# How far back the lookup searches (tokens): bounds a step's host work on long contexts.
NGRAM_WINDOW = 4096
BACKOFF_MIN_DRAFTED = 16
BACKOFF_RATE = 0.2
BACKOFF_STEPS = 32
# After a step in which no request had a draft, this many steps run without speculation (and so
# with overlap scheduling, which a drafting step gives up).
QUIET_STEPS = 8


def propose_ngram(token_ids: list[int], k: int, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix (n_max down
    to n_min tokens) of `token_ids`; [] when no suffix recurs."""
    total = len(token_ids)
    lo = max(0, total - NGRAM_WINDOW)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = token_ids[total - n :]
        first = suffix[0]
        # The latest start i < total - n with token_ids[i:i+n] == suffix (scan backwards).
        for i in range(total - n - 1, lo - 1, -1):
            if token_ids[i] == first and token_ids[i : i + n] == suffix:
                return token_ids[i + n : i + n + k]
    return []


@dataclass
class SpecStats:
    """Cumulative draft and accepted tokens, per adapter ("" = the base model), for metrics."""

    drafted: dict[str, int]
    accepted: dict[str, int]

    def add(self, adapter: str | None, drafted: int, accepted: int) -> None:
        key = adapter or ""
        self.drafted[key] = self.drafted.get(key, 0) + drafted
        self.accepted[key] = self.accepted.get(key, 0) + accepted

    def forget(self, adapter: str) -> None:
        self.drafted.pop(adapter, None)
        self.accepted.pop(adapter, None)


class Speculator:
    """Decides each step's drafts (`draft`) and accounts for what verification accepted (`record`).

    `propose(token_ids, k) -> up to k draft tokens`: `propose_ngram` when serving; tests and the
    benchmark's forced-acceptance mode give their own (random weights never repeat themselves)."""

    def __init__(
        self,
        num_draft_tokens: int,
        disable_batch_size: int,
        context_length: int,
        propose: Callable[[list[int], int], list[int]] = propose_ngram,
        draft_runner: DraftRunner | None = None,
        sampling_inputs: Callable[[list[Request]], SamplingInputs] | None = None,
    ):
        self.propose = propose
        # --speculative-algorithm draft: the draft model proposes for the whole batch at once
        # (`sampling_inputs`: the drafting requests' settings, for sampled drafts).
        self.draft_runner = draft_runner
        self.sampling_inputs = sampling_inputs
        self.k = num_draft_tokens
        self.disable_batch_size = disable_batch_size
        self.context_length = context_length
        self.stats = SpecStats({}, {})
        self.num_steps = 0
        self._quiet_until = 0  # no speculation before this step (a step found nothing to draft)
        # Measurement only (`force_acceptance`): each draft token accepted with this probability
        # whatever the target says, so random weights (which never agree with a draft) show the
        # mechanics of a given acceptance rate. None when serving.
        self.forced_rate: float | None = None
        self._forced_rng = random.Random(0)

    def force_acceptance(self, rate: float, seed: int = 0) -> None:
        """Benchmarks: draft K copies of the last token and accept each with probability `rate`
        (stopping at the first rejection). Outputs are then meaningless; step costs are real."""
        self.forced_rate = rate
        self._forced_rng = random.Random(seed)
        self.propose = lambda token_ids, k: [token_ids[-1]] * k

    def forced(self, draft: list[int], run: Verified) -> Verified:
        """`run` replaced by a forced-acceptance run of `draft` (see `force_acceptance`)."""
        accepted = 0
        while accepted < len(draft) and self._forced_rng.random() < self.forced_rate:
            accepted += 1
        nxt = draft[accepted] if accepted < len(draft) else run.tokens[-1]
        return Verified(draft[:accepted] + [nxt], accepted, run.nonfinite)

    def eligible(self, req: Request) -> bool:
        p = req.params
        return (
            req.grammar is None
            and p.repetition_penalty == 1
            and not p.frequency_penalty
            and not p.presence_penalty
            and req.num_output_tokens >= p.min_tokens
            and req.num_output_tokens >= 1
        )

    def speculates(self, running: list[Request]) -> bool:
        """Whether the next step drafts: few enough requests run and one of them may draft. A step
        that does not keeps overlap scheduling (the engine's choice, per step)."""
        self.num_steps += 1
        if self.draft_runner is not None:
            self.draft_runner.release_others(running)  # every step: finished requests' draft KV goes
        if self.num_steps < self._quiet_until:
            return False
        return len(running) <= self.disable_batch_size and any(self._may_draft(r) for r in running)

    def _may_draft(self, req: Request) -> bool:
        return req.spec_paused_until <= self.num_steps and self.eligible(req)

    def draft(self, running: list[Request]) -> None:
        """Set `draft_ids` on the running requests about to decode ([] for the others); the engine
        calls it after `speculates` said yes (and after resolving an in-flight step)."""
        drafted = False
        batch: list[tuple[Request, int]] = []
        for req in running:
            req.draft_ids = []
            req.draft_probs = None
            if req.num_uncomputed_tokens != 1 or not self._may_draft(req):
                continue
            # Room: the output's remaining tokens (the bonus token is one of them) and the context.
            room = min(
                self.k,
                req.max_new_tokens - req.num_output_tokens - 1,
                self.context_length - len(req.token_ids) - 1,
            )
            if room <= 0:
                continue
            if self.draft_runner is None:
                req.draft_ids = self.propose(req.token_ids, room)
                drafted = drafted or bool(req.draft_ids)
            else:
                batch.append((req, room))
        if batch:  # the draft model proposes for all of them at once
            reqs = [r for r, _ in batch]
            drafts = self.draft_runner.propose(reqs, [n for _, n in batch], self.sampling_inputs(reqs))
            for req, ids, q in zip(reqs, drafts, drafts.probs, strict=True):
                req.draft_ids, req.draft_probs = ids, q
                drafted = drafted or bool(ids)
        if not drafted:  # nothing to draft: the next steps keep overlap scheduling
            self._quiet_until = self.num_steps + QUIET_STEPS

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        self.stats.add(req.adapter, drafted, accepted)
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        if req.spec_drafted >= BACKOFF_MIN_DRAFTED and req.spec_accepted < BACKOFF_RATE * req.spec_drafted:
            req.spec_paused_until = self.num_steps + BACKOFF_STEPS
            req.spec_drafted = req.spec_accepted = 0  # judged afresh after the pause
