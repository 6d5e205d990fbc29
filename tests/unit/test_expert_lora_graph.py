"""`--expert-lora-mode graphs` (lora/expert_lora_graph.py): the expert deltas from device tensors only
match the per-expert reference, read the slots at run time (as a replayed CUDA graph's buffer
changes under them), and split into grouped GEMM calls of fewer than SPAN_MAX_GROUPS groups."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.lora import expert_lora as expert_lora_module
from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
from loraplex.services.inference.models import moe as moe_module
from tests.unit.test_expert_lora import HIDDEN, SHAPES, E, _moe, _pool, _reference

pytestmark = pytest.mark.skipif(
    not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm"
)

# base, three expert adapters of mixed ranks, one adapter without expert LoRA (slot 2), interleaved
SLOTS = [-1, 0, 1, 0, 2, 3, 1, -1, 3, 0, 1, 1, 2, 0]


def _check(lora: GraphExpertLoRA, moe, x, slots, weights) -> None:
    for layer in range(SHAPES.num_layers):
        got = moe(x, expert_lora=lora.at(layer))
        torch.testing.assert_close(got, _reference(moe, x, slots, weights, layer), rtol=1e-4, atol=1e-4)


def _run_on_slots() -> tuple[GraphExpertLoRA, torch.nn.Module, torch.Tensor]:
    """The graphs mode over SLOTS, checked against the reference on every layer."""
    pool, weights = _pool()
    lora, moe = GraphExpertLoRA(pool), _moe()
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    x = torch.randn(slots.numel(), HIDDEN, generator=torch.Generator().manual_seed(9))
    lora.prepare(slots)
    _check(lora, moe, x, slots, weights)
    return lora, moe, x


@pytest.mark.parametrize("path", ["dense", "sorted"])
def test_graph_expert_lora_matches_per_expert_reference(path, monkeypatch):
    monkeypatch.setattr(moe_module, "DENSE_MAX_TOKENS", 64 if path == "dense" else 0)
    lora, moe, x = _run_on_slots()
    base = moe(x)
    got = moe(x, expert_lora=lora.at(0))
    torch.testing.assert_close(got[[0, 4, 7, 12]], base[[0, 4, 7, 12]], rtol=1e-5, atol=1e-6)


def test_slots_are_read_when_the_step_runs_not_at_prepare():
    """A captured graph keeps the tensor `prepare` got and replays with the slots written into it later."""
    pool, weights = _pool()
    lora, moe = GraphExpertLoRA(pool), _moe()
    buffer = torch.full((len(SLOTS),), -1, dtype=torch.int32)
    lora.prepare(buffer)
    x = torch.randn(len(SLOTS), HIDDEN, generator=torch.Generator().manual_seed(3))
    for slots in (SLOTS, SLOTS[::-1], [3] * len(SLOTS)):
        buffer.copy_(torch.tensor(slots, dtype=torch.int32))
        _check(lora, moe, x, buffer.clone(), weights)


def test_calls_of_fewer_than_span_max_groups_give_the_same_numbers(monkeypatch):
    """With room for one slot a call (the prefix group of rows before a chunk counts too), every
    slot's chunk is its own pair of grouped GEMMs."""
    monkeypatch.setattr(expert_lora_module, "SPAN_MAX_GROUPS", E + 2)
    calls = []
    grouped_mm = torch.nn.functional.grouped_mm

    def counting(*args, **kwargs):
        calls.append(kwargs["offs"].numel())
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counting)
    _run_on_slots()
    # 4 slots: 4 calls a module (shrink and expand), the first of E groups, the later of E + 1
    assert calls[:8] == [E, E, E + 1, E + 1, E + 1, E + 1, E + 1, E + 1]


@pytest.mark.parametrize("graph_safe", [True, False])
def test_engine_keeps_cuda_graphs_only_for_the_graphs_mode(graph_safe):
    """engine/startup.py on CUDA: with `--expert-lora-mode graphs` the graphs stay as the base experts'
    path allows (all of them with the grouped kernel); the host-reading modes turn them off."""
    from types import SimpleNamespace

    from loraplex.services.inference.engine.config import EngineConfig
    from loraplex.services.inference.engine.startup import _capturable

    config = EngineConfig(device="cpu", cuda_graph_max_bs=256)
    loaded = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(is_moe=False))
    backend = SimpleNamespace(experts=SimpleNamespace(graph_safe=graph_safe))
    got = _capturable(config, loaded, backend)
    assert got.disable_cuda_graph == (not graph_safe)
    assert got.cuda_graph_max_bs == 256
    assert got.mixed_cuda_graph_max_tokens == config.mixed_cuda_graph_max_tokens


def test_warm_up_computes_expert_lora_in_its_steps_and_restores_the_mode():
    """engine/warmup.py: the host-reading mode would skip expert LoRA with no adapter loaded, so the
    warm-up runs the graphs mode over the same pool (compiling the grouped kernel's delta variant),
    then puts the engine's mode back."""
    from types import SimpleNamespace

    from loraplex.services.inference.engine.warmup import warm_up
    from loraplex.services.inference.lora.expert_lora import ExpertLoRA

    pool, _ = _pool()
    experts = ExpertLoRA(pool)
    seen = []
    backend = SimpleNamespace(
        pool=SimpleNamespace(slots=pool.slots), experts=experts, max_step_distinct=lambda: pool.slots
    )
    runner = SimpleNamespace(
        lora_backend=backend,
        config=SimpleNamespace(num_kv_heads=2),
        page_size=16,
        device=torch.device("cpu"),
        kv_cache=torch.empty(0, dtype=torch.bfloat16),  # a float cache (FP8's decode tiles differ)
        forward=lambda chunks: seen.append(backend.experts),
    )
    ran = warm_up(runner, max_num_tokens=64, max_num_seqs=8, context_length=128)
    assert ran == len(seen) > 0
    assert all(isinstance(e, GraphExpertLoRA) and e.pool is pool for e in seen)
    assert backend.experts is experts


def test_auto_mode_takes_graphs_on_cuda_where_it_fits_and_grouped_elsewhere():
    """`--expert-lora-mode auto` (the default, lora/setup.py): graphs on CUDA with bfloat16 factors
    at a rank that is a multiple of 8 (CUDA's grouped GEMM), grouped there otherwise and on the CPU;
    a mode asked for by name is kept."""
    from types import SimpleNamespace

    from loraplex.services.inference.lora.setup import expert_lora_mode

    def cuda_pool(dtype, rank):
        factors = SimpleNamespace(device=torch.device("cuda"), dtype=dtype)
        return SimpleNamespace(a={"experts.gate_up_proj": factors}, max_rank=rank)

    cpu_pool, _ = _pool()
    assert expert_lora_mode("auto", cpu_pool) == "grouped"
    assert expert_lora_mode("graphs", cpu_pool) == "graphs"
    assert expert_lora_mode("auto", cuda_pool(torch.bfloat16, 16)) == "graphs"
    assert expert_lora_mode("auto", cuda_pool(torch.bfloat16, 12)) == "grouped"
    assert expert_lora_mode("auto", cuda_pool(torch.float16, 16)) == "grouped"
    assert expert_lora_mode("span", cuda_pool(torch.bfloat16, 16)) == "span"
    with pytest.raises(ValueError, match="bfloat16"):
        GraphExpertLoRA(cuda_pool(torch.float16, 16))
