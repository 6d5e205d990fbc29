"""Speculative decoding's verification: a step's draft rows accepted or rejected against the
target's own, and that step's outputs (drafting and its back-off: engine/speculative.py).

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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.services.inference.engine.logprobs import StepLogprobs, rows_logprobs
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import (
    MIN_TEMPERATURE,
    SamplingInputs,
    filtered_probs,
    nonfinite_rows,
    read_sampled,
)


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
