"""What a step samples with, from its live requests: each row's settings, the history that
penalties read, the token ids a request may not sample now, and the grammar mask of constrained
rows. OutputProcessor (request_outputs.py) holds the requests and the counts that let a step skip
what none of them needs; the engine's step calls these once per step.
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.grammar import allocate_bitmask, mask_logits
from loraplex.services.inference.engine.overlap import InFlightStep
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import SamplingInputs
from loraplex.services.inference.engine.types import SamplingParams


def needs_history(params: SamplingParams) -> bool:
    """Sampling reads the request's output ids on the host (penalties, bad words): under overlap
    scheduling the step before is resolved first, so no placeholder is read."""
    return (
        params.repetition_penalty != 1
        or bool(params.frequency_penalty)
        or bool(params.presence_penalty)
        or bool(params.bad_words_ids)
    )


def sampling_inputs(
    reqs: list[Request],
    eos_token_ids: frozenset[int],
    vocab_size: int,
    any_penalized: bool,
    any_masking: bool,
) -> SamplingInputs:
    """One row per request. `any_penalized` / `any_masking`: whether a live request needs its
    history read / its tokens biased or masked (False: the step skips that work for every row)."""
    ps = [r.params for r in reqs]
    history = any_penalized and any(needs_history(p) for p in ps)
    return SamplingInputs(
        temperature=[p.temperature for p in ps],
        top_k=[p.top_k for p in ps],
        top_p=[p.top_p for p in ps],
        min_p=[p.min_p for p in ps],
        repetition_penalty=[p.repetition_penalty for p in ps],
        frequency_penalty=[p.frequency_penalty for p in ps],
        presence_penalty=[p.presence_penalty for p in ps],
        generators=[r.generator for r in reqs],
        prompt_ids=[r.prompt_ids for r in reqs] if history else [[] for _ in reqs],
        output_ids=[r.output_ids for r in reqs] if history else [[] for _ in reqs],
        banned=[banned_tokens(r, eos_token_ids, vocab_size) for r in reqs],
        bias=[r.params.logit_bias for r in reqs] if any_masking else None,
        allowed=[r.params.allowed_token_ids for r in reqs] if any_masking else None,
    )


def banned_tokens(req: Request, eos_token_ids: frozenset[int], vocab_size: int) -> tuple[int, ...]:
    """Token ids `req` may not sample now: its stop tokens while it is short of min_tokens (the
    output count at sampling time includes an overlap placeholder, i.e. the tokens before this one)."""
    params = req.params
    bad = _bad_word_ends(req) if params.bad_words_ids else ()
    if req.num_output_tokens >= params.min_tokens:
        return bad
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    # a stop id outside the vocabulary can never be sampled
    return bad + eos + tuple(t for t in params.stop_token_ids if t < vocab_size)


def _bad_word_ends(req: Request) -> tuple[int, ...]:
    """The last id of each bad word whose other ids end the output so far (vLLM's rule)."""
    out = req.output_ids
    ends = []
    for word in req.params.bad_words_ids:
        head = list(word[:-1])
        if not head or (len(out) >= len(head) and out[len(out) - len(head) :] == head):
            ends.append(word[-1])
    return tuple(ends)


def mask_constrained(
    logits: torch.Tensor,
    reqs: list[Request],
    pending: InFlightStep | None,
    live: dict[str, Request],
) -> torch.Tensor:
    """`logits` with the grammar mask applied to the rows of constrained requests. Under overlap
    scheduling (`pending`: the step launched before this one, its tokens not yet processed) a
    constrained row's previous token is still on the device: wait for that step's sampling
    (already done: this step's forward is queued behind it) and accept its tokens first, for the
    requests still `live` (the engine's requests by id)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    if pending is not None and any(reqs[i].token_ids[-1] < 0 for i in rows):
        tokens = pending.host_tokens()
        for req, pos, token in zip(pending.requests, pending.positions, tokens, strict=True):
            if req.grammar is not None and live.get(req.request_id) is req:
                req.grammar.accept(pos - req.num_prompt_tokens, token)
    bitmask = allocate_bitmask(len(rows), logits.shape[1], pin=logits.is_cuda)
    for k, i in enumerate(rows):
        reqs[i].grammar.fill(bitmask, k)
    return mask_logits(logits, rows, bitmask)
