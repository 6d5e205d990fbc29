"""Pearson's chi-square goodness-of-fit test, for the checks that sampled tokens follow a distribution."""

from __future__ import annotations

import torch


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """The p-value of `counts` drawn from `probs` (outcomes of probability 0 left out): the upper tail
    of Pearson's statistic, through the regularized upper incomplete gamma function."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)
    dof = sum(1 for p in probs if p > 0) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
