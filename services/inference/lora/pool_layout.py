"""The adapter pool's page layout in numbers (lora/pool.py holds the buffers): rank rows per page,
pages per adapter, bytes per page and per pool, and the pool's own free list of pages.
docs/architecture.md, "LoRA pool layout", states the formulas."""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.expert_lora import expert_pool_nbytes
from loraplex.services.inference.lora.shapes import ModelShapes

_TABLE_BYTES = 4 + 4  # int32 rank + float32 scaling per (layer, slot, stacked module)
# Rank rows per page (a pool of max rank below it: that rank). 8: the common ranks (8, 16, 32, 64)
# fill their pages exactly (a rank-4 adapter in a rank-64 pool pays 8 rows, which the expand's loads
# round up to anyway), and a bf16 row of 8 B values is one 16-byte vector; a smaller page only adds
# page-table entries for ranks nobody trains.
PAGE_ROWS = 8


def page_rows(max_rank: int) -> int:
    """Rank rows per page of a pool of `max_rank` (`P` in the layout)."""
    return max(1, min(PAGE_ROWS, max_rank))


def pages_for_rank(rank: int, max_rank: int) -> int:
    """Pages an adapter whose largest rank (over the pool's groups) is `rank` takes in a pool of
    `max_rank`."""
    return -(-rank // page_rows(max_rank))


def allocated_groups(target_modules: Iterable[str]) -> list[str]:
    wanted = set(target_modules)
    return [g for g, mods in GROUPS.items() if wanted & set(mods)]


def page_nbytes(shapes: ModelShapes, max_rank: int, target_modules: Iterable[str], dtype: torch.dtype) -> int:
    """Bytes of one page: `sum_g L * P * (n*d + sum(w)) * dtype_bytes` over the allocated groups."""
    elem, rows = torch.empty((), dtype=dtype).element_size(), page_rows(max_rank)
    return sum(
        shapes.num_layers * rows * (len(GROUPS[g]) * shapes.group_in(g) + sum(shapes.group_widths(g))) * elem
        for g in allocated_groups(target_modules)
    )


def default_pages(slots: int, max_rank: int) -> int:
    """The pages that let every slot hold a rank-`max_rank` adapter at once."""
    return slots * pages_for_rank(max_rank, max_rank)


def pool_nbytes(
    shapes: ModelShapes,
    slots: int,
    max_rank: int,
    target_modules: Iterable[str],
    dtype: torch.dtype,
    num_pages: int | None = None,
) -> int:
    """The documented formula: `pages * page_nbytes + sum_g L*slots*n*8 + slots*ceil(R/P)*4`
    (+ the experts' buffers); `num_pages` None: `default_pages(slots, max_rank)`."""
    pages = default_pages(slots, max_rank) if num_pages is None else num_pages
    groups = allocated_groups(target_modules)
    tables = sum(shapes.num_layers * slots * len(GROUPS[g]) * _TABLE_BYTES for g in groups)
    tables += slots * pages_for_rank(max_rank, max_rank) * 4 if groups else 0
    total = pages * page_nbytes(shapes, max_rank, target_modules, dtype) + tables
    # LoRA on the experts (experts.gate_up_proj / experts.down_proj targeted): lora/expert_lora.py
    return total + expert_pool_nbytes(shapes, slots, max_rank, target_modules, dtype)


class FreePages:
    """Where a pool's pages come from: its own buffers' pages, lowest free page first (a heap).
    lora/unified.py's `KVRuns` hands out pages inside the KV cache's blocks instead."""

    def __init__(self, num_pages: int):
        self._heap = list(range(num_pages))

    def available(self, returned: int = 0) -> int:
        """Pages an upload could take now, were `returned` pages in use given back first."""
        return len(self._heap) + returned

    def take(self) -> int:
        return heapq.heappop(self._heap)

    def give(self, page: int) -> None:
        heapq.heappush(self._heap, page)
