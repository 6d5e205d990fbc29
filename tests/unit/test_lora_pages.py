"""Rank pages (issue 57, "one memory budget", stage A): adapters take pages of their own rank, never
the pool's largest; any free page serves any adapter; an upload short of pages evicts idle adapters
only, never one a request computes with. The real AdapterPool and LoRAManager on the CPU, the torch
backend (the numerical reference) against a naive per-token LoRA."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.errors import CapacityExceeded
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool, PoolFull
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend
from tests.unit.test_lora_manager import StepClock
from tests.unit.test_lora_pool_backend import SHAPES, naive_delta, random_adapter


def check_backend(pool: AdapterPool, adapters: dict, seed: int = 0) -> None:
    """Every group's torch-backend delta over a batch holding every slot in `adapters` (slot ->
    weights) equals the naive per-token delta of each slot's own adapter."""
    gen = torch.Generator().manual_seed(seed)
    slots = [s for s in adapters for _ in range(3)] + [-1]
    backend = TorchLoRABackend(pool)
    backend.prepare(torch.tensor(slots, dtype=torch.int32))
    work = 0.0
    for layer in range(pool.shapes.num_layers):
        for group in pool.groups:
            x = torch.randn(len(slots), pool.shapes.group_in(group), generator=gen)
            out = torch.zeros(len(slots), sum(pool.shapes.group_widths(group)))
            backend.apply(layer, group, x, out)
            expected = naive_delta(x, slots, adapters, layer, group)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
            work += float(expected.abs().sum())
    assert work > 0, "the batch does no LoRA work: the check would prove nothing"


def test_mixed_ranks_take_their_own_pages_not_the_largest_rank():
    # ranks 4, 8, 16 and 64 in one rank-64 pool: 1 + 1 + 2 + 8 pages of 8 rank rows
    pool = AdapterPool(
        SHAPES, slots=4, max_rank=64, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    adapters = {
        s: random_adapter(SHAPES, list(ALL_MODULES), rank=r, seed=s) for s, r in enumerate((4, 8, 16, 64))
    }
    for slot, weights in adapters.items():
        pool.upload(slot, weights)
    own = [pool.pages_needed(w) for w in adapters.values()]
    assert own == [1, 1, 2, 8]
    assert pool.pages_in_use == sum(own) == 12
    # the bytes in use are the adapters' own pages (a padded pool would use 4 x 8 pages)
    assert pool.pages_in_use * pool.page_nbytes == sum(n * pool.page_nbytes for n in own)
    assert pool.pages_in_use * pool.page_nbytes < 4 * pool.pages_per_slot * pool.page_nbytes / 2.5
    assert sorted(p for s in range(4) for p in pool.host_pages[s]) == list(range(12))
    check_backend(pool, adapters)


def test_freed_pages_serve_any_adapter_without_fragmentation():
    pool = AdapterPool(
        SHAPES,
        slots=8,
        max_rank=32,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
        num_pages=8,
    )
    small = {s: random_adapter(SHAPES, ["q_proj", "down_proj"], rank=8, seed=10 + s) for s in range(8)}
    for slot, weights in small.items():
        pool.upload(slot, weights)
    assert pool.free_pages == 0 and [pool.host_pages[s] for s in range(8)] == [[s] for s in range(8)]
    big = random_adapter(SHAPES, list(ALL_MODULES), rank=32, seed=99)
    with pytest.raises(PoolFull):
        pool.upload(1, big)  # 4 pages needed, 1 free for slot 1
    assert pool.host_pages[1] == [1] and pool.free_pages == 0, "a refused upload keeps the slot's pages"
    # every other adapter leaves: the free pages are scattered, and any of them serves
    for slot in (1, 3, 5, 7):
        pool.release(slot)
    assert pool.free_pages == 4
    pool.upload(1, big)
    assert pool.host_pages[1] == [1, 3, 5, 7]
    assert pool.page_table[1].tolist() == [1, 3, 5, 7]
    check_backend(pool, {0: small[0], 1: big, 2: small[2], 4: small[4], 6: small[6]}, seed=1)
    # and back: the big adapter's pages serve four small ones again
    pool.release(1)
    for slot in (1, 3, 5, 7):
        pool.upload(slot, small[slot])
    assert pool.free_pages == 0
    check_backend(pool, small, seed=2)


@pytest.fixture(scope="module")
def paged_adapters(tiny_llama_path, adapter_factory):
    return {
        "s0": adapter_factory(tiny_llama_path, "pages-s0", r=8, target_modules=["q_proj"], seed=70),
        "s1": adapter_factory(tiny_llama_path, "pages-s1", r=8, target_modules=["q_proj"], seed=71),
        "big": adapter_factory(
            tiny_llama_path, "pages-big", r=16, target_modules=["q_proj", "v_proj"], seed=72
        ),
    }


def test_upload_short_of_pages_evicts_idle_adapters_never_a_computing_one(tiny_llama_path, paged_adapters):
    # 4 slots, but pages for one rank-16 adapter only (two rank-8 ones)
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=4,
        max_rank=16,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
        num_pages=2,
    )
    m = LoRAManager(pool, clock=StepClock())
    for name, path in paged_adapters.items():
        m.load_adapter(name, path)
    s0, s1 = m.acquire("s0"), m.acquire("s1")
    assert (s0, s1) == (0, 1) and pool.free_pages == 0
    rows = pool.lora_a["qkv"][:, pool.host_pages[s0]].clone()
    assert m.acquire("big") is None, "both pages are computing: the big adapter waits"
    m.release("s0")  # one page idle: still not enough, and s1 computes
    assert m.acquire("big") is None
    assert m._slots[s1].name == "s1" and pool.host_pages[s1] == [1]
    assert torch.equal(pool.lora_a["qkv"][:, pool.host_pages[s0]], rows), "s0's page was not reused"
    m.release("s1")  # now both idle adapters go back to the host tier for the big one
    slot = m.acquire("big")
    assert slot is not None and pool.host_pages[slot] == [0, 1]
    assert {v.name: v.slot for v in m._active.values()} == {"s0": -1, "s1": -1, "big": slot}
    assert m._evictions == {"s0": 1, "s1": 1}
    m.release("big")
    # the small ones come back into the big one's pages (it is idle: evicted for them)
    assert m.acquire("s0") is not None and m.acquire("s1") is not None
    assert pool.pages_in_use == 2 and m._active["big"].slot == -1


def test_pinned_adapters_leave_pages_for_a_max_rank_upload(tiny_llama_path, paged_adapters):
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=4,
        max_rank=16,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
        num_pages=3,
    )
    m = LoRAManager(pool, clock=StepClock())
    for name, path in paged_adapters.items():
        m.load_adapter(name, path)
    m.pin("s0")  # 1 pinned page + 2 for any rank-16 adapter = 3
    with pytest.raises(CapacityExceeded, match="pages"):
        m.pin("s1")


def test_kv_reclaim_takes_idle_adapters_least_recently_used_never_a_computing_one(
    tiny_llama_path, paged_adapters
):
    """The KV cache's reclaim (lora/unified.py binds it): what it counts as free and what it evicts."""
    clock = StepClock()
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=4,
        max_rank=16,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
    )
    m = LoRAManager(pool, clock=clock)
    m.run_blocks = 3  # KV blocks per page
    for name, path in paged_adapters.items():
        m.load_adapter(name, path)
    for name in ("s1", "big", "s0"):  # s1 used first: least recently used
        clock.now += 1
        m.acquire(name)
    m.release("s1")
    m.release("big")
    assert m.reclaimable_blocks() == (1 + 2) * 3  # s0 computes: its page is not the KV cache's
    m.reclaim_blocks(1)
    assert m._active["s1"].slot == -1 and m._active["big"].slot >= 0, "least recently used first"
    m.reclaim_blocks(100)
    assert m._active["big"].slot == -1 and m._active["s0"].slot >= 0, "a computing adapter stays"
    assert m.reclaimable_blocks() == 0 and m.num_reclaims == 2 and pool.pages_in_use == 1


def test_a_resident_adapter_waiting_for_the_share_is_served_by_a_drain(tiny_llama_path, paged_adapters):
    """Pages in the KV cache (--lora-memory unified): computing adapters hold at most the pool's share.
    A resident adapter over it waits in the slot queue, and aged waiters drain a busy slot for it."""
    clock = StepClock()
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=4,
        max_rank=16,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
    )
    pool.guaranteed_pages = 2  # the share: one rank-8 adapter computing beside... one more page
    m = LoRAManager(pool, clock=clock, slot_wait_s=1.0, min_resident_s=0.0)
    for name, path in paged_adapters.items():
        m.load_adapter(name, path)
    assert m.acquire("s1") is not None
    m.release("s1")  # resident, idle
    assert m.acquire("big") is not None  # 2 pages computing: the share is full
    assert m.acquire("s1") is None and "s1" in m.slot_queue(), "over the share: it waits in the queue"
    assert m._active["s1"].slot >= 0, "it stays resident meanwhile"
    assert not m.yielding()
    clock.now += 2.0  # aged: a busy slot drains for it
    m.note_queued({"s1": 1})
    assert m.yielding() == frozenset({"big"})
    m.suspend("big")
    assert m.acquire("s1") is not None and "s1" not in m.slot_queue()
