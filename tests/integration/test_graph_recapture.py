"""Recapturing decode graphs (benchmarks do, after switching a LoRA option) leaves the KV cache as
it was: the eager warm-up before each capture must not replay the last step's KV writes. CUDA only
(on the GPU machine: `python3 -m pytest -m gpu tests/integration/test_graph_recapture.py`)."""

from __future__ import annotations

import pytest
import torch

from loraplex.bench.random_runner import TINY, build_runner

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recapture_writes_no_kv_and_keeps_replays_right():
    device = torch.device("cuda")
    runner = build_runner(
        TINY,
        dtype=torch.bfloat16,
        device=device,
        slots=4,
        rank=8,
        max_num_tokens=64,
        max_num_seqs=8,
        context_length=256,
    )
    runner.capture_cuda_graphs(8)
    graphs = runner.cuda_graphs
    # What a replayed decode step of 8 tokens over 4 adapters leaves in the graphs' buffers.
    graphs.input_ids[:8] = torch.arange(3, 11, device=device)
    graphs.positions[:8] = 5
    graphs.slot_mapping[:8] = torch.arange(8, device=device) * 16 + 5
    graphs.context_lens[:8] = 6
    graphs.block_tables[:8, 0] = torch.arange(8, device=device, dtype=torch.int32)
    graphs.token_slots[:8] = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], device=device, dtype=torch.int32)
    before = runner.kv_cache.clone()
    graphs.recapture([(8, 0, 0), (8, 1, 0), (4, 1, 0)])
    torch.cuda.synchronize()
    assert torch.equal(runner.kv_cache, before)
    assert (graphs.slot_mapping == -1).all() and (graphs.token_slots == -1).all()
