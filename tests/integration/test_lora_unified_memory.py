"""One memory budget for the adapter pool and the KV cache (issue 57 stage B, --lora-memory unified):
the tiny model's real engine on the CPU, PEFT as the reference.

- greedy tokens equal PEFT's and the separate pool's, with the pool's tensors inside the KV cache;
- a burst of long prompts shrinks the resident adapters (the KV cache reclaims idle adapters' pages,
  every long prompt completes) and they come back when it ends, with unchanged outputs;
- an adapter a request computes with is never reclaimed.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.engine.unified_blocks import UnifiedBlocks
from loraplex.services.inference.lora import setup as lora_setup
from loraplex.services.inference.lora.pool_layout import page_nbytes, pool_nbytes
from loraplex.services.inference.lora.shapes import ModelShapes
from tests.support.child import REPO, child_env, run_child
from tests.support.lora_reference import (
    BATCH,
    NEW_TOKENS,
    PROMPTS,
    make_adapters,
    peft_greedy,
    server_args,
    sync_engine,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """See conftest.one_torch_thread."""


def generate(engine, prompts, adapters, n=NEW_TOKENS):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=n), list(adapters))
    return [o.token_ids for o in outs]


def test_unified_pool_matches_peft_and_the_separate_pool(tiny_llama_path, adapter_factory):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    flags = dict(max_loras_per_batch=None, max_gpu_loras=4)
    unified = sync_engine(server_args(tiny_llama_path, adapters, lora_memory="unified", **flags))
    blocks, pool = unified.block_manager, unified.adapter_slots.pool
    assert isinstance(blocks, UnifiedBlocks)
    kv = unified.runner.kv_cache
    lo, hi = kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()
    assert all(lo <= t.data_ptr() < hi for t in (*pool.lora_a.values(), *pool.lora_b.values()))
    prompts = [unified.tokenizer(p).input_ids for p in PROMPTS[: len(BATCH)]]
    got = generate(unified, prompts, BATCH)
    assert pool.pages_in_use == 1 + 1 + 2 + 8 and blocks.page_blocks == 12 * blocks.run_blocks
    separate = sync_engine(server_args(tiny_llama_path, adapters, **flags))
    assert got == generate(separate, prompts, BATCH)
    assert got == peft_greedy(tiny_llama_path, adapters, list(zip(prompts, BATCH, strict=True)))


# 4 slots, q/v adapters, a cache of 64 blocks of 16 tokens of its own
BURST_FLAGS = dict(
    max_gpu_loras=4,
    max_loras_per_batch=None,
    lora_target_modules=("q_proj", "v_proj"),
    max_total_tokens=1024,
    chunked_prefill_size=256,
    max_num_batched_tokens=256,
)


def long_prompts(ids: list[int], count: int) -> list[list[int]]:
    """`count` distinct 240-token prompts (no prefix shared: each takes its own 15 blocks)."""
    return [[7 + i, *(ids * 200)][:240] for i in range(count)]


@pytest.fixture(scope="module")
def small_adapters(tiny_llama_path, adapter_factory):
    return {
        f"u{i}": adapter_factory(
            tiny_llama_path, f"unified-u{i}", r=8, target_modules=["q_proj", "v_proj"], seed=90 + i
        )
        for i in range(4)
    }


def test_a_burst_of_long_prompts_shrinks_resident_adapters_and_they_come_back(
    tiny_llama_path, small_adapters, monkeypatch
):
    # The pool's own share: 2 pages of the 4 adapters' 4 (sized from memory: a CPU budget of 2 pages
    # and 4 slots' tables); 4 slots.
    shapes = ModelShapes.from_model_dir(tiny_llama_path)
    page = page_nbytes(shapes, 8, ("q_proj", "v_proj"), torch.float32)
    tables = pool_nbytes(shapes, 4, 8, ("q_proj", "v_proj"), torch.float32, num_pages=0)
    monkeypatch.setattr(lora_setup, "CPU_POOL_BYTES", 2 * page + tables)
    engine = sync_engine(server_args(tiny_llama_path, small_adapters, lora_memory="unified", **BURST_FLAGS))
    manager, pool, blocks = engine.adapter_slots, engine.adapter_slots.pool, engine.block_manager
    assert pool.guaranteed_pages == 2 and pool.slots == 4
    names = list(small_adapters)
    short = [engine.tokenizer(p).input_ids for p in PROMPTS[:4]]
    before = generate(engine, short, names, n=8)
    # all four resident: two in the pool's share, two in blocks the KV cache is not using
    assert manager.slots_used() == 4 and pool.pages_in_use == 4 and manager.num_reclaims == 0
    # a burst of long base prompts needs nearly the whole cache: idle adapters go to the host tier
    # 4 x 16 blocks of the 70 (64 the cache's own, 2 pages of 3 blocks the pool's share): more than the
    # 58 the resident adapters' pages leave loose
    burst = generate(engine, long_prompts(short[3], 4), [None] * 4, n=4)
    assert all(len(t) == 4 for t in burst), "every long prompt completes"
    assert manager.num_reclaims > 0 and blocks.num_reclaims > 0
    assert manager.slots_used() < 4
    # the cache had all it had beside a separate pool: the same tokens, no more preemptions
    separate = sync_engine(server_args(tiny_llama_path, small_adapters, **BURST_FLAGS))
    generate(separate, short, names, n=8)
    assert generate(separate, long_prompts(short[3], 4), [None] * 4, n=4) == burst
    assert engine.scheduler.num_preemptions == separate.scheduler.num_preemptions == 0
    # the burst is over: the adapters come back, with the same tokens
    assert generate(engine, short, names, n=8) == before
    assert manager.slots_used() == 4 and pool.pages_in_use == 4


def test_an_adapter_computing_is_never_reclaimed(tiny_llama_path, small_adapters, monkeypatch):
    engine = sync_engine(server_args(tiny_llama_path, small_adapters, lora_memory="unified", **BURST_FLAGS))
    manager = engine.adapter_slots
    evict = manager._evict
    evicted_busy: list[str] = []

    def watched(slot):
        v = manager._slots[slot]
        if v is not None and v.refs:
            evicted_busy.append(v.name)
        evict(slot)

    manager._evict = watched
    names = list(small_adapters)
    short = [engine.tokenizer(p).input_ids for p in PROMPTS[:4]]
    generate(engine, short, names, n=4)  # all four resident, idle
    # one adapter decodes beside the burst: the others may go, never it
    out = generate(engine, [short[0], *long_prompts(short[3], 4)], [names[0], None, None, None, None], n=24)
    assert manager.num_reclaims > 0 and not evicted_busy
    assert out[0][:4] == generate(engine, [short[0]], [names[0]], n=4)[0]


def test_triton_backend_over_pages_in_the_kv_cache_gives_the_separate_pools_tokens(
    tiny_llama_path, adapter_factory
):
    """The Triton kernels read the pages through the KV cache's strides (interpreter, child process)."""
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    script = str(REPO / "tests" / "support" / "unified_memory_check.py")
    argv = [script, str(tiny_llama_path), *(f"{n}={p}" for n, p in adapters.items())]
    out = run_child(argv, env=child_env(interpret=True), timeout=600).stdout
    lines = out.strip().splitlines()
    assert len(lines) == len(PROMPTS) and all(line.startswith("ok ") for line in lines), out
