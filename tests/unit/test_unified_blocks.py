"""The one free list of KV blocks and rank pages (engine/unified_blocks.py): the KV side takes the
highest blocks, pages the lowest whole runs; a page never takes the last `watermark` loose blocks; the
KV side counts idle adapters' blocks as free and reclaims them before it allocates."""

from __future__ import annotations

import pytest

from loraplex.services.inference.engine.unified_blocks import UnifiedBlocks


def blocks(**kw) -> UnifiedBlocks:
    args = dict(run_blocks=4, num_runs=5, watermark=4, kv_blocks=16)
    args.update(kw)
    return UnifiedBlocks(24, 16, **args)


def test_kv_takes_the_highest_blocks_and_pages_the_lowest_whole_runs():
    b = blocks()
    table: list[int] = []
    b.allocate(table, 3 * 16)
    assert table == [23, 22, 21]
    assert [b.take_run(), b.take_run()] == [0, 1]
    assert b.page_blocks == 8 and b.loose_blocks == 24 - 3 - 8
    # a run one of whose blocks a request holds is not free for a page
    b.allocate(table, 10 * 16)  # 7 more: 20..14, into run 3 (blocks 12-15)
    assert table[-1] == 14
    assert b.take_run() == 2 and b.runs_available() == 0  # run 3 is held, run 4 is past the loose ones
    b.free(table)
    b.give_run(1)
    assert b.loose_blocks == 24 - 8 and b.take_run() == 1


def test_pages_never_take_the_last_watermark_loose_blocks():
    b = blocks(watermark=9)
    assert b.runs_available() == (24 - 9) // 4 == 3
    table: list[int] = []
    b.allocate(table, 8 * 16)  # 16 loose left
    assert b.runs_available() == (16 - 9) // 4 == 1
    assert b.runs_available(returned=2) == 3  # were two pages given back first
    b.take_run()
    assert b.runs_available() == 0 and b.loose_blocks == 12


def test_kv_counts_idle_adapters_blocks_and_reclaims_them_before_it_allocates():
    b = blocks()
    held = {0: 4, 1: 4}  # run -> blocks, two idle adapters' pages
    for _ in held:
        b.take_run()
    b.reclaimable = lambda: sum(held.values())
    calls: list[int] = []

    def reclaim(n: int) -> None:
        calls.append(n)
        while n > 0 and held:
            run = min(held)
            n -= held.pop(run)
            b.give_run(run)

    b.reclaimer = reclaim
    assert b.num_free_blocks == 24  # the scheduler's admission sees the adapters' blocks as free
    table: list[int] = []
    b.allocate(table, 20 * 16)  # 16 loose: 4 more needed, one adapter goes
    assert calls == [4] and held == {1: 4} and len(table) == 20 and b.num_reclaims == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        b.reclaimer = lambda n: None  # an adapter that cannot go (it computes): the allocation fails
        b.allocate(table, 21 * 16)
    assert b.capacity_tokens == 16 * 16  # a request is never admitted past the cache's own blocks


def test_a_page_drops_cached_prefix_blocks_in_its_run():
    b = UnifiedBlocks(8, 16, run_blocks=4, num_runs=2, watermark=0, prefix_cache=True)
    table: list[int] = []
    b.allocate(table, 8 * 16)
    b.register(b"k", table[-1])  # block 0 cached (the last block taken: the lowest)
    assert table[-1] == 0
    b.free(table)
    assert b.num_cached_blocks == 1 and b.runs_available() == 2
    assert b.take_run() == 0
    assert b.num_cached_blocks == 0 and b.match([b"k"]) == []
