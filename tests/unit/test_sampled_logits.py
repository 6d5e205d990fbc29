"""The decode graphs' sampled rows (engine/cuda_graph.py `sampled_logits`), device-agnostic so the CPU
checks the case the H100 run of 2026-12-08 crashed on: a draft model's catch-up step samples no row,
and `torch.tensor([])` is a float tensor, which cannot index."""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.cuda_graph import sampled_logits


def test_no_sampled_row_gives_an_empty_batch_of_logits():
    logits = torch.randn(8, 5)  # a graph's static buffer: its bucket's rows
    out = sampled_logits(logits, 3, [])
    assert out.shape == (0, 5)


def test_sampled_rows_are_the_steps_own():
    logits = torch.randn(8, 5)
    assert torch.equal(sampled_logits(logits, 3, [0, 1, 2]), logits[:3])  # every row: no gather
    assert torch.equal(sampled_logits(logits, 4, [1, 3]), logits[[1, 3]])  # verify rows, a prefix's last
