"""The start-up warm-up never builds a step with more sequences than the runner holds."""

import pytest
import torch

from loraplex.services.inference.engine.warmup import warm_up_steps


@pytest.mark.parametrize("max_num_seqs", [2, 5, 17, 65])
@pytest.mark.parametrize("num_slots", [0, 8, 24])
def test_warm_up_steps_fit_max_num_seqs(max_num_seqs: int, num_slots: int) -> None:
    steps = warm_up_steps(2048, max_num_seqs, num_slots, 8, 4096, 16, torch.device("cpu"))
    assert steps
    assert max(len(chunks) for chunks in steps) <= max_num_seqs
    assert max(sum(len(c.token_ids) for c in chunks) for chunks in steps) <= 2048


def test_compiles_count_as_stalls_only_between_engine_builds() -> None:
    from loraplex.kernels.compile_watch import CompileCounter

    counter = CompileCounter()
    counter._hook(fn=None)  # start-up of the first engine
    counter.mark_serving()
    counter._hook(fn=None)  # a stall while serving
    counter.mark_starting()  # a second engine is built in the same process (the benchmarks)
    counter._hook(fn=None)
    counter.mark_serving()
    assert (counter.total, counter.after_start) == (3, 1)


def test_warm_up_prefills_use_ids_any_vocabulary_has() -> None:
    """Warm-up steps feed the real model: a prefill of 400 tokens must not use ids up to 399 (a tiny
    model's 128-row embedding table asserted on CUDA)."""
    steps = warm_up_steps(2048, 8, 2, 8, 448, 16, torch.device("cpu"))
    assert {t for step in steps for chunk in step for t in chunk.token_ids} == {0}


def _most_distinct(steps) -> int:
    return max(len({c.lora_slot for c in chunks if c.lora_slot >= 0}) for chunks in steps)


def test_a_lora_tier_no_step_can_reach_is_neither_warmed_up_nor_captured() -> None:
    """Under --max-loras-per-batch 4 over 64 slots no step holds more than 16 distinct adapters: the
    warm-up builds no such step, and the CUDA graphs (engine/cuda_graph.py, mixed_graphs.py)
    capture no tier-2 graph (kernels/lora_plan.py graph_tiers)."""
    from loraplex.kernels.lora_configs import MANY_ADAPTERS
    from loraplex.kernels.lora_plan import graph_tiers

    assert _most_distinct(warm_up_steps(2048, 64, 64, 8, 4096, 16, torch.device("cpu"))) > MANY_ADAPTERS
    capped = warm_up_steps(2048, 64, 64, 8, 4096, 16, torch.device("cpu"), max_distinct=4)
    assert _most_distinct(capped) <= MANY_ADAPTERS
    assert graph_tiers(None) == (0,)
    assert graph_tiers(MANY_ADAPTERS) == (0, 1)
    assert graph_tiers(MANY_ADAPTERS + 1) == (0, 1, 2)


def test_an_fp8_cache_has_its_own_decode_tiles_and_the_warm_up_covers_them() -> None:
    """Over an FP8 cache decode attention takes 128-key tiles and 3 stages from 128 (sequence, kv
    head) programs (bf16: 64-key tiles at 3 stages, 2 past head dim 128); each (tile, padded split
    count) a decode batch can launch over either cache is among the batches the warm-up runs for it."""
    from loraplex.kernels.attention_decode import decode_block_n, decode_num_stages, decode_variants

    assert [decode_block_n(b, 8, kv_fp8=True) for b in (1, 15, 16, 256)] == [64, 64, 128, 128]
    assert [decode_block_n(b, 8) for b in (1, 127, 128, 256)] == [64, 64, 64, 64]
    assert [decode_num_stages(128, True), decode_num_stages(64, True)] == [3, 2]
    assert [decode_num_stages(64, False), decode_num_stages(64, False, head_dim=256)] == [3, 2]
    cpu = torch.device("cpu")
    for fp8 in (False, True):
        variants = decode_variants(256, 8, cpu, kv_fp8=fp8)
        assert {block for block, _ in variants} == ({64, 128} if fp8 else {64})
        steps = warm_up_steps(2048, 256, 0, 8, 4096, 16, cpu, kv_fp8=fp8)
        decode_batches = {sum(1 for c in chunks if len(c.token_ids) == 1) for chunks in steps}
        assert set(variants.values()) <= decode_batches
