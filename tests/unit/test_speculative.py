"""Speculative decoding's parts: n-gram drafts (engine/speculative.py) and exact verification
(engine/speculative_verify.py). The engine with speculation on:
tests/integration/test_speculative_engine.py."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.services.inference.engine.sampler import SamplingInputs
from loraplex.services.inference.engine.speculative import propose_ngram
from loraplex.services.inference.engine.speculative_verify import verify
from tests.support.chi_square import chi_square_p


def test_ngram_proposes_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    # the latest occurrence wins, and the longest suffix first
    assert propose_ngram([5, 6, 7, 1, 6, 8, 5, 6], 2) == [7, 1]
    assert propose_ngram([1, 2, 3], 4) == []
    assert propose_ngram([7, 7, 7], 2) == [7]  # only what exists after the match


def _inputs(rows: int, temperature: float, generators) -> SamplingInputs:
    return SamplingInputs(
        temperature=[temperature] * rows,
        top_k=[0] * rows,
        top_p=[1.0] * rows,
        min_p=[0.0] * rows,
        repetition_penalty=[1.0] * rows,
        frequency_penalty=[0.0] * rows,
        presence_penalty=[0.0] * rows,
        generators=generators,
        prompt_ids=[[] for _ in range(rows)],
        output_ids=[[] for _ in range(rows)],
    )


def test_greedy_verification_accepts_up_to_the_first_mismatch():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 5]):
        logits[row, best] = 5.0
    gens = [None] * 4
    assert verify(logits, [[2, 3, 4]], _inputs(4, 0.0, gens))[0].tokens == [2, 3, 1]
    assert verify(logits, [[2, 3, 1]], _inputs(4, 0.0, gens))[0].tokens == [2, 3, 1, 5]
    assert verify(logits, [[0, 3, 1]], _inputs(4, 0.0, gens))[0] == ([2], 0, False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verification_flags_a_request_with_a_non_finite_row(temperature):
    """A NaN or Inf in any row of a request's draft positions flags that request (read in the
    verification's one host copy), and only that request."""
    logits = torch.randn(7, 6)
    logits[5, 2] = float("nan")  # the second request's second row
    logits[0, 1] = 40.0  # the first request's rows stay finite, even when large
    gens = [torch.Generator().manual_seed(i) for i in range(7)]
    runs = verify(logits, [[1, 2], [3, 4, 0]], _inputs(7, temperature, gens))
    assert [r.nonfinite for r in runs] == [False, True]
    logits[5, 2] = float("-inf")
    runs = verify(logits, [[1, 2], [3, 4, 0]], _inputs(7, temperature, gens))
    assert [r.nonfinite for r in runs] == [False, True]


@pytest.mark.parametrize("draft_token", [0, 3])
def test_sampled_verification_emits_the_targets_distribution(draft_token):
    """The first emitted token is distributed as the target's first row, whatever the draft (a likely
    draft token 0 and an unlikely one 3); when the draft is accepted, the next as the second row."""
    target = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2]])
    trials = 4000
    # One verification of `trials` requests with the same draft and rows, each its own generator.
    gens = [g for seed in range(trials) for g in [torch.Generator().manual_seed(seed)] * 2]
    runs = verify(target.log().repeat(trials, 1), [[draft_token]] * trials, _inputs(2 * trials, 1.0, gens))
    first = [0] * 4
    second = [0] * 4
    for run in runs:
        first[run.tokens[0]] += 1
        if run.accepted:
            second[run.tokens[1]] += 1
    # a false alarm 1 time in 1000 per check
    assert chi_square_p(first, target[0].tolist()) > 1e-3, first
    assert sum(second) == first[draft_token]
    assert chi_square_p(second, target[1].tolist()) > 1e-3, second
    # the acceptance rate is the draft token's target probability
    rate = first[draft_token] / trials
    assert abs(rate - target[0, draft_token].item()) < 4 * math.sqrt(0.25 / trials)


def test_sampled_verification_with_a_draft_distribution_emits_the_targets():
    """A draft model's tokens drawn from q (not one-hot): accepting d with probability min(1, p(d)/q(d))
    and resampling rejections from max(0, p - q) gives the target's p for the first token, and its
    second row for the token after an accepted draft; the acceptance rate is sum(min(p, q))."""
    target = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.5, 0.3], [0.25, 0.25, 0.25, 0.25]])
    trials = 4000
    draws = torch.multinomial(q[0], trials, replacement=True, generator=torch.Generator().manual_seed(9))
    drafts = [[int(d)] for d in draws]
    gens = [g for seed in range(trials) for g in [torch.Generator().manual_seed(seed)] * 2]
    runs = verify(target.log().repeat(trials, 1), drafts, _inputs(2 * trials, 1.0, gens), [q[:1]] * trials)
    first = [0] * 4
    second = [0] * 4
    accepted = 0
    for run in runs:
        first[run.tokens[0]] += 1
        if run.accepted:
            accepted += 1
            second[run.tokens[1]] += 1
    assert chi_square_p(first, target[0].tolist()) > 1e-3, first
    assert chi_square_p(second, target[1].tolist()) > 1e-3, second
    # 0.5 here; read as one-hot (the n-gram rule: accept with p(d)) it would be sum(q * p) = 0.2
    rate = torch.minimum(target[0], q[0]).sum().item()
    assert abs(accepted / trials - rate) < 4 * math.sqrt(0.25 / trials)
