"""Speculative decoding: draft a few tokens cheaply, verify them in one target step.

Drafting (`--speculative-algorithm ngram`, prompt lookup): the draft for a request is what followed
the most recent earlier occurrence of its last n tokens (n from `NGRAM_MAX` down to `NGRAM_MIN`)
in its own prompt and output. It costs no model and no adapter: each request's draft follows what
its own adapter has written so far. With `--speculative-algorithm draft` a smaller model with the
target's tokenizer drafts instead (engine/draft_runner.py): K batched decode steps of its own, a
greedy request drafting its argmax and a sampled one sampling from the draft's distribution q.

Verification: a request with a draft computes its last token and its K draft tokens in one chunk
of the step (each position with the request's adapter, like any prefill chunk), and the runner
returns the logits of all K+1 positions. Greedy rows accept draft tokens while each equals the
argmax of the position before it; sampled rows use rejection sampling: token d drafted from q at a
position where the target has p is accepted with probability min(1, p(d) / q(d)), and a rejection
samples from max(0, p - q) renormalized (an n-gram draft is one token with probability 1, so d is
accepted with probability p(d) and a rejection samples from p without d). Either way the
first mismatch is replaced by the target's own token and, when every draft token is accepted,
one more token is sampled from the last position: each step emits 1..K+1 tokens, distributed
exactly as the target's one-token-at-a-time decoding (the random draws differ, so a seed gives a
different, equally distributed, output than without speculation).

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
from typing import NamedTuple

import torch

from loraplex.services.inference.engine.draft_runner import DraftRunner
from loraplex.services.inference.engine.logprobs import StepLogprobs, rows_logprobs
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import (
    MIN_TEMPERATURE,
    SamplingInputs,
    filtered_probs,
    nonfinite_rows,
    read_sampled,
)

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


class Verified(NamedTuple):
    """One request's verification: the tokens to emit (accepted drafts, then the target's own)."""

    tokens: list[int]
    accepted: int  # draft tokens among them
    nonfinite: bool = False  # a NaN or Inf in one of its rows' logits: none of it may be served


def verify(
    logits: torch.Tensor,
    drafts: list[list[int]],
    inp: SamplingInputs,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> list[Verified]:
    """Rejection-sample each request's draft against its K+1 rows of `logits` (in order; row j of a
    request is the target's distribution for the token after its j-th chunk position).

    `inp` has one entry per row (each request's settings repeated over its rows). `draft_probs`:
    per request, the draft distribution q of each of its draft positions (`[>= len(draft), vocab]`,
    a draft model's), or None for a draft that is one token with probability 1 (n-gram). A draft
    token d where the target has p is accepted with probability min(1, p(d) / q(d)); a rejection
    samples from max(0, p - q), renormalized, which with one-hot q is p without d. One host read,
    which also brings the rows' non-finite flags (`Verified.nonfinite`)."""
    device = logits.device
    greedy = torch.tensor([t < MIN_TEMPERATURE for t in inp.temperature])
    at_row = [t for d in drafts for t in (*d, None)]  # each row's draft token (None: the bonus row)
    bad = nonfinite_rows(logits).long()
    if bool(greedy.all()):
        best, bad_l = torch.stack([logits.max(dim=-1).indices, bad]).tolist()
        return _walk(drafts, [t == b for t, b in zip(at_row, best, strict=True)], best, bad_l)
    probs = filtered_probs(logits, inp)
    rows = probs.shape[0]
    q = _draft_distribution(probs, drafts, draft_probs)
    # Each row's draft token (the bonus row has none: token 0, where its q row is all zero).
    draft_col = torch.zeros(rows, dtype=torch.int64)
    at = 0
    for d in drafts:
        draft_col[at : at + len(d)] = torch.tensor(d, dtype=torch.int64)
        at += len(d) + 1
    draft_col = draft_col.to(device)[:, None]
    p_draft = probs.gather(1, draft_col)[:, 0]
    q_draft = q.gather(1, draft_col)[:, 0]
    residual = (probs - q).clamp_(min=0.0)
    # p == q leaves nothing (a rejection then has probability 0, up to rounding): fall back to p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    # One uniform and one exponential race per row, from each request's own generator.
    uniforms = torch.zeros(rows, device=device)
    races = torch.ones_like(probs)
    for i, g in enumerate(inp.generators):
        if not greedy[i]:
            uniforms[i : i + 1].uniform_(generator=g)
            races[i].exponential_(generator=g)
    accept = uniforms * q_draft < p_draft  # u < p(d) / q(d), without dividing by a zero q
    drawn = (residual / races).max(dim=-1).indices
    best = logits.max(dim=-1).indices
    accept_l, drawn_l, best_l, bad_l = torch.stack([accept.long(), drawn, best, bad]).tolist()
    # Greedy rows accept by exact match and fall back to the argmax; sampled rows as drawn above.
    accepts = [
        t == b if g else bool(a) for t, b, g, a in zip(at_row, best_l, greedy.tolist(), accept_l, strict=True)
    ]
    fallbacks = [b if g else x for b, g, x in zip(best_l, greedy.tolist(), drawn_l, strict=True)]
    return _walk(drafts, accepts, fallbacks, bad_l)


def _walk(
    drafts: list[list[int]], accepts: list[bool], fallbacks: list[int], bad: list[int]
) -> list[Verified]:
    """Per request (its rows in order): its draft tokens while each row accepts, then the first
    rejecting row's fallback token, or the bonus row's when every draft token was accepted; flagged
    non-finite when any of its rows is."""
    out, at = [], 0
    for d in drafts:
        tokens: list[int] = []
        for j in range(len(d) + 1):
            if j < len(d) and accepts[at + j]:
                tokens.append(d[j])
                continue
            tokens.append(fallbacks[at + j])
            break
        out.append(Verified(tokens, len(tokens) - 1, any(bad[at : at + len(d) + 1])))
        at += len(d) + 1
    return out


def _draft_distribution(
    probs: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None] | None
) -> torch.Tensor:
    """q per row of `probs`: the draft model's rows where given, one-hot at the draft token otherwise,
    zero on each request's bonus row."""
    q = torch.zeros_like(probs)
    at = 0
    for i, d in enumerate(drafts):
        given = draft_probs[i] if draft_probs is not None else None
        if given is not None:
            q[at : at + len(d)] = given[: len(d)].to(q.dtype)
        elif d:
            rows = torch.arange(at, at + len(d), device=probs.device)
            q[rows, torch.tensor(d, dtype=torch.int64, device=probs.device)] = 1.0
        at += len(d) + 1
    return q


def verify_step(engine, entries, chunks, logits: torch.Tensor) -> list:
    """The outputs of a step with verify chunks (`engine`: the LLMEngine that ran its forward).

    `logits` has one row per sampled chunk, K+1 for a verify chunk, in chunk order. Rows of other
    requests are sampled as in any step; verify chunks are accepted (`verify`), their requests' KV
    kept for the last token and the accepted drafts only (the rejected positions' KV is overwritten
    when they are computed again, and never offered to the prefix cache, which registers computed
    tokens only), and their tokens processed as one run each."""
    processor = engine.output_processor
    plain_rows: list[int] = []
    plain: list[Request] = []
    spec: list[tuple[Request, list[int]]] = []
    spec_rows: list[int] = []
    at = 0
    for (req, n), chunk in zip(entries, chunks, strict=True):
        if not chunk.verify:
            req.num_computed_tokens += n
        if not chunk.sample:
            continue
        if chunk.verify:
            spec.append((req, list(chunk.token_ids[1:])))
            spec_rows.extend(range(at, at + n))
            at += n
        else:
            plain_rows.append(at)
            plain.append(req)
            at += 1
    device = logits.device
    outputs = []
    if plain:
        index = torch.tensor(plain_rows, dtype=torch.int64).to(device, non_blocking=True)
        device_tokens, step_logprobs, device_nonfinite = engine._sample(logits.index_select(0, index), plain)
        tokens, nonfinite = read_sampled(device_tokens, device_nonfinite)
        lps = rows_logprobs(step_logprobs, tokens)
        outputs.extend(processor.process(plain, tokens, None, lps, nonfinite))
    index = torch.tensor(spec_rows, dtype=torch.int64).to(device, non_blocking=True)
    spec_logits = logits.index_select(0, index)
    expanded = [req for req, draft in spec for _ in range(len(draft) + 1)]
    verified = verify(
        spec_logits,
        [d for _, d in spec],
        processor.sampling_inputs(expanded),
        [req.draft_probs for req, _ in spec],
    )
    if engine.speculator.forced_rate is not None:
        verified = [engine.speculator.forced(d, run) for (_, d), run in zip(spec, verified, strict=True)]
    logprobs = _run_logprobs(spec_logits, spec, verified)
    for (req, draft), run, lps in zip(spec, verified, logprobs, strict=True):
        req.num_computed_tokens += 1 + run.accepted
        req.draft_ids = []
        req.draft_probs = None
        if run.nonfinite:  # a NaN or Inf in any of its positions' logits: the request ends with an error
            outputs.extend(processor.process([req], [0], None, None, [True]))
            continue
        engine.speculator.record(req, len(draft), run.accepted)
        outputs.append(processor.process_run(req, run.tokens, lps))
    return outputs


def _run_logprobs(logits: torch.Tensor, spec, verified: list[Verified]) -> list[list | None]:
    """Per verified request that asked for log probabilities, one TokenLogprob per emitted token
    (each from its own position's row); None for the others."""
    rows, tops, at = [], [], 0
    row_tokens = [0] * logits.shape[0]
    for (req, draft), run in zip(spec, verified, strict=True):
        if req.params.logprobs is not None:
            for j, token in enumerate(run.tokens):
                rows.append(at + j)
                tops.append(req.params.logprobs)
                row_tokens[at + j] = token
        at += len(draft) + 1
    if not rows:
        return [None] * len(spec)
    tokens = torch.tensor(row_tokens, dtype=torch.int64).to(logits.device, non_blocking=True)
    by_row = StepLogprobs(logits, tokens, rows, tops).per_row(row_tokens)
    out, at = [], 0
    for (req, draft), run in zip(spec, verified, strict=True):
        out.append(
            [by_row[at + j] for j in range(len(run.tokens))] if req.params.logprobs is not None else None
        )
        at += len(draft) + 1
    return out
