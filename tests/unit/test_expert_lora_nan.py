"""A slot whose expert LoRA holds NaN (an adapter past the load check) reaches no other token's rows
(issue 59, H3 (b) on MoE bases): every expert-LoRA mode (loop, grouped, the slot span, the graphs mode)
over both torch expert paths (dense, sorted) gives the other slots' tokens and the base tokens exactly
what they get beside a finite slot 0."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.lora.expert_lora import ExpertLoRA
from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
from loraplex.services.inference.models import moe as moe_module
from tests.unit.test_expert_lora import HIDDEN, SHAPES, _moe, _pool, _reference

SLOTS = torch.tensor([-1, 0, 1, 0, 2, 3, 1, -1, 3, 0, 1, 1, 2, 0], dtype=torch.int32)
MODES = {
    "loop": lambda pool: ExpertLoRA(pool, grouped=False),
    "grouped": lambda pool: ExpertLoRA(pool, grouped=True),
    "span": lambda pool: ExpertLoRA(pool, grouped=True, span=True),
    "graphs": GraphExpertLoRA,
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("path", ["dense", "sorted"])
def test_a_nan_expert_slot_stays_in_its_tokens(mode, path, monkeypatch):
    if mode != "loop" and not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    monkeypatch.setattr(moe_module, "DENSE_MAX_TOKENS", 64 if path == "dense" else 0)
    pool, weights = _pool()
    for module in pool.modules:  # slot 0: NaN everywhere, its padding included
        pool.a[module][:, 0] = float("nan")
        pool.b[module][:, 0] = float("nan")
    lora, moe = MODES[mode](pool), _moe()
    x = torch.randn(SLOTS.numel(), HIDDEN, generator=torch.Generator().manual_seed(9))
    lora.prepare(SLOTS)
    others = SLOTS != 0
    for layer in range(SHAPES.num_layers):
        got = moe(x, expert_lora=lora.at(layer))
        want = _reference(moe, x, SLOTS, weights, layer)
        assert torch.isnan(got[~others]).all(dim=-1).all()  # the poison reached slot 0's tokens
        torch.testing.assert_close(got[others], want[others], rtol=1e-4, atol=1e-4)
