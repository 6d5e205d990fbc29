"""The adapter pool's pages inside the KV cache's memory (issue 57, "one memory budget", stage B):
how one rank page (lora/pool.py) fits in KV blocks, and the pool's tensors as views of the cache.

The KV cache is `[L, 2 (k, v), blocks, page_size, kv_heads, head_dim]`: in layer `l`, block `b`
owns one K chunk and one V chunk of `C = page_size * kv_heads * head_dim * kv_elem` bytes, at
`b * C` in the layer's K half and in its V half. A rank page takes `k` consecutive blocks
`[p*k, (p+1)*k)` (a run): in every layer a run is `k*C` contiguous bytes in the K half and as
many in the V half. The page's per-layer parts (each group's A part `[n*P, d]` and B part
`[P, W]`) are packed into those two runs, largest first onto the emptier half (`fit_page`), and
the pool's `lora_a[g]` / `lora_b[g]` become strided views of the cache's raw bytes (`page_views`):
page stride `k*C`, layer stride the cache's, rows contiguous as before. The kernels and the torch
backend read them unchanged (they take strides); an FP8 cache (1-byte elements) is viewed as bytes
and reinterpreted in the adapters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.pool_layout import allocated_groups, page_rows
from loraplex.services.inference.lora.shapes import ModelShapes

if TYPE_CHECKING:
    from loraplex.services.inference.engine.unified_blocks import UnifiedBlocks
    from loraplex.services.inference.lora.manager import LoRAManager

ALIGN = 16  # bytes: every part starts 16-byte aligned (Triton specialises pointers on it)


@dataclass(frozen=True)
class PageFit:
    """Where one rank page lives in a run of `blocks` KV blocks, per layer."""

    blocks: int  # KV blocks per rank page (k)
    chunk: int  # bytes of one block's K (or V) chunk in one layer (C)
    parts: dict[
        tuple[str, str], tuple[int, int]
    ]  # (group, "a" | "b") -> (half 0=K 1=V, byte offset in the run)
    page_bytes: int  # the page's own bytes per layer (the parts, unpadded)

    @property
    def waste(self) -> float:
        """Share of the run's bytes the page does not use (alignment and the last chunk)."""
        return 1.0 - self.page_bytes / (2 * self.blocks * self.chunk)


def kv_chunk_bytes(page_size: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    return page_size * kv_heads * head_dim * torch.empty((), dtype=kv_dtype).element_size()


def part_bytes(
    shapes: ModelShapes, max_rank: int, target_modules: Iterable[str], dtype: torch.dtype
) -> dict[tuple[str, str], int]:
    """Bytes per layer of each part of one rank page: A `[n*P, d]` and B `[P, W]` per allocated group."""
    elem, P = torch.empty((), dtype=dtype).element_size(), page_rows(max_rank)
    out = {}
    for g in allocated_groups(target_modules):
        out[(g, "a")] = len(GROUPS[g]) * P * shapes.group_in(g) * elem
        out[(g, "b")] = P * sum(shapes.group_widths(g)) * elem
    return out


def fit_page(
    shapes: ModelShapes, max_rank: int, target_modules: Iterable[str], dtype: torch.dtype, chunk: int
) -> PageFit:
    """Pack one rank page's parts onto the K and V halves of a run (largest part first, onto the
    half holding fewer bytes), then the fewest blocks whose chunks hold the fuller half."""
    sizes = part_bytes(shapes, max_rank, target_modules, dtype)
    load = [0, 0]
    parts: dict[tuple[str, str], tuple[int, int]] = {}
    for key, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        half = 0 if load[0] <= load[1] else 1
        parts[key] = (half, load[half])
        load[half] += -(-size // ALIGN) * ALIGN
    blocks = max(1, -(-max(load) // chunk))
    return PageFit(blocks, chunk, parts, sum(sizes.values()))


def page_views(
    kv_cache: torch.Tensor,
    fit: PageFit,
    shapes: ModelShapes,
    max_rank: int,
    target_modules: Iterable[str],
    dtype: torch.dtype,
    num_pages: int,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`lora_a[g]` `[L, num_pages, n*P, d]` and `lora_b[g]` `[L, num_pages, P, W]` as views of
    `kv_cache`'s bytes, rank page `p` in blocks `[p*k, (p+1)*k)` (blocks past `num_pages * k` stay
    the cache's alone)."""
    L, _, num_blocks = kv_cache.shape[:3]
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous to hold adapter pages")
    if num_pages * fit.blocks > num_blocks:
        raise ValueError(f"{num_pages} rank pages of {fit.blocks} blocks exceed the cache's {num_blocks}")
    elem = torch.empty((), dtype=dtype).element_size()
    if fit.chunk % elem or any(off % elem for _, off in fit.parts.values()):
        raise ValueError(f"KV chunks of {fit.chunk} bytes do not hold whole {dtype} elements")
    arena = kv_cache.view(-1).view(torch.uint8).view(dtype)
    half = num_blocks * fit.chunk // elem  # elements of one layer's K (or V) half
    layer, page = 2 * half, fit.blocks * fit.chunk // elem
    P = page_rows(max_rank)
    lora_a: dict[str, torch.Tensor] = {}
    lora_b: dict[str, torch.Tensor] = {}
    for g in allocated_groups(target_modules):
        n, d, w = len(GROUPS[g]), shapes.group_in(g), sum(shapes.group_widths(g))
        side, off = fit.parts[(g, "a")]
        lora_a[g] = arena.as_strided((L, num_pages, n * P, d), (layer, page, d, 1), side * half + off // elem)
        side, off = fit.parts[(g, "b")]
        lora_b[g] = arena.as_strided((L, num_pages, P, w), (layer, page, w, 1), side * half + off // elem)
    return lora_a, lora_b


class KVRuns:
    """The pool's page source when its pages live in the KV cache (`AdapterPool.page_source`): rank
    page `p` is run `p` of the shared block allocator (engine/unified_blocks.py)."""

    def __init__(self, blocks: UnifiedBlocks):
        self.blocks = blocks

    def available(self, returned: int = 0) -> int:
        return self.blocks.runs_available(returned)

    def take(self) -> int:
        return self.blocks.take_run()

    def give(self, page: int) -> None:
        self.blocks.give_run(page)


def bind(pool: AdapterPool, manager: LoRAManager, blocks: UnifiedBlocks) -> None:
    """Draw the pool's pages from `blocks`, and let the KV side reclaim idle adapters' pages."""
    pool.page_source = KVRuns(blocks)
    blocks.reclaimer = manager.reclaim_blocks
    blocks.reclaimable = manager.reclaimable_blocks
    manager.run_blocks = blocks.run_blocks
