"""One free list for the KV cache's blocks and the adapter pool's rank pages (issue 57, "one memory
budget"; S-LoRA's unified paging, lora/unified.py says how a page sits in blocks).

Rank page `p` is the run of blocks `[p*k, (p+1)*k)`, `p < num_runs`. The KV side takes single blocks,
the highest free one first, so the low runs stay whole for pages; a page takes the lowest run none of
whose blocks a request holds (cached prefix blocks in it are dropped from the index). Rules:
- The KV side sees as free its loose blocks plus the blocks idle adapters hold (`reclaimable`), so the
  scheduler's admission counts them; when an allocation needs more than the loose blocks, idle
  adapters are evicted first (`reclaimer`, the LoRA manager: least recently used, never one a request
  computes with) and the allocation then takes their blocks.
- A page is taken only while at least `watermark` loose blocks stay free after it: memory the KV cache
  is not using goes to adapters, never the last of it. Between the KV side reclaiming a page and a page
  taking those blocks back, the KV side must have freed `watermark` blocks, so the two cannot thrash
  step to step.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token
from loraplex.services.inference.engine.loading import LoadedModel
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.pool_layout import default_pages
from loraplex.services.inference.lora.unified import fit_page, kv_chunk_bytes, page_views

log = logging.getLogger(__name__)


class UnifiedBlocks(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        *,
        run_blocks: int,
        num_runs: int,
        watermark: int,
        kv_blocks: int | None = None,
        prefix_cache: bool = False,
    ):
        """`kv_blocks`: the blocks the KV cache had beside a separate pool (its guaranteed part: what
        a request may need at most; None: all)."""
        super().__init__(num_blocks, page_size, prefix_cache=prefix_cache)
        self.kv_blocks = num_blocks if kv_blocks is None else kv_blocks
        if num_runs * run_blocks > num_blocks:
            raise ValueError(f"{num_runs} runs of {run_blocks} blocks exceed the {num_blocks} blocks")
        self._free = list(range(num_blocks))  # sorted: the KV side pops the highest
        self.run_blocks, self.num_runs, self.watermark = run_blocks, num_runs, watermark
        self._held_in_run = [0] * num_runs  # blocks of each run a request holds
        self._runs: set[int] = set()  # runs holding a rank page
        # Set by the LoRA manager (lora/unified.py `bind`): evict idle adapters until at least n more
        # blocks are loose; the blocks idle adapters hold.
        self.reclaimer: Callable[[int], None] | None = None
        self.reclaimable: Callable[[], int] = lambda: 0
        self.num_reclaims = 0  # allocations that evicted adapters first (for metrics and tests)

    # -- the KV side ---------------------------------------------------------------------

    @property
    def loose_blocks(self) -> int:
        """Blocks no request and no rank page holds (cached prefix blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free_blocks(self) -> int:
        return self.loose_blocks + self.reclaimable()

    @property
    def capacity_tokens(self) -> int:
        """The longest a request may get: the blocks the cache has to itself however busy adapters are."""
        return self.kv_blocks * self.page_size

    @property
    def page_blocks(self) -> int:
        """Blocks holding rank pages."""
        return len(self._runs) * self.run_blocks

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        short = self.blocks_for(num_tokens) - len(block_table) - self.loose_blocks
        if short > 0 and self.reclaimer is not None:
            self.reclaimer(short)
            self.num_reclaims += 1
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > self.loose_blocks:
            raise RuntimeError(f"KV cache exhausted: need {need} blocks, {self.loose_blocks} free")
        super().allocate(block_table, num_tokens)

    def free(self, block_table: list[int]) -> None:
        for block in reversed(block_table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            self._note(block, -1)
            if block in self._key_of:
                self._evictable[block] = None
            else:
                bisect.insort(self._free, block)
        block_table.clear()

    def reuse(self, block_table: list[int], blocks: list[int]) -> None:
        for block in blocks:
            if self._refs[block] == 0:
                self._note(block, +1)
        super().reuse(block_table, blocks)

    def reset_prefix_cache(self, enabled: bool) -> None:
        for block in self._evictable:
            bisect.insort(self._free, block)
        self._evictable.clear()
        self._index.clear()
        self._key_of.clear()
        self.prefix_cache = enabled

    def _take_free(self) -> int:
        block = super()._take_free()
        self._note(block, +1)
        return block

    def _note(self, block: int, held: int) -> None:
        run = block // self.run_blocks
        if run < self.num_runs:
            self._held_in_run[run] += held

    # -- rank pages ----------------------------------------------------------------------

    def runs_available(self, returned: int = 0) -> int:
        """Pages a rank-page upload could take now, were `returned` pages given back first: free runs,
        bounded so that `watermark` loose blocks stay."""
        free_runs = sum(1 for p in range(self.num_runs) if not self._held_in_run[p] and p not in self._runs)
        by_watermark = (self.loose_blocks + returned * self.run_blocks - self.watermark) // self.run_blocks
        return max(0, min(free_runs + returned, by_watermark))

    def take_run(self) -> int:
        """The lowest free run for a rank page (its cached prefix blocks leave the index)."""
        for p in range(self.num_runs):
            if not self._held_in_run[p] and p not in self._runs:
                break
        else:
            raise RuntimeError("no run of KV blocks is free for a rank page")
        for block in range(p * self.run_blocks, (p + 1) * self.run_blocks):
            i = bisect.bisect_left(self._free, block)
            if i < len(self._free) and self._free[i] == block:
                del self._free[i]
            else:  # a cached block nobody holds: forget it
                del self._evictable[block]
                del self._index[self._key_of.pop(block)]
                self.num_evictions += 1
        self._runs.add(p)
        return p

    def give_run(self, p: int) -> None:
        self._runs.remove(p)
        for block in range(p * self.run_blocks, (p + 1) * self.run_blocks):
            bisect.insort(self._free, block)


# Loose KV blocks a rank page never takes: this share of the blocks, at least one page's run.
WATERMARK_SHARE = 0.05


def unified_kv_cache(
    loaded: LoadedModel, config: EngineConfig, pool: AdapterPool, plan_blocks: Callable[[int], int]
) -> tuple[torch.Tensor, UnifiedBlocks]:
    """The KV cache with the adapter pool's pages inside it: `plan_blocks(reserved_bytes)` sizes the
    cache as beside a separate pool of `pool.guaranteed_pages` pages, and the pool's share is added
    as blocks (`k` per page, lora/unified.py `fit_page`), so the cache never has fewer blocks to
    itself than before once idle adapters are reclaimed, and the pages may take more while it does not
    use them. The pool's tensors become views of the cache (`AdapterPool.adopt`)."""
    c, kv_dtype = loaded.config, config.kv_dtype(loaded.dtype)
    chunk = kv_chunk_bytes(config.page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    fit = fit_page(pool.shapes, pool.max_rank, pool.target_modules, pool.dtype, chunk)
    share = pool.guaranteed_pages * fit.blocks
    block_bytes = config.page_size * kv_bytes_per_token(c, kv_dtype)
    own = plan_blocks(share * block_bytes)
    num_blocks = own + share
    kv_cache = allocate_kv_cache(c, num_blocks, config.page_size, kv_dtype, loaded.device)
    num_runs = min(num_blocks // fit.blocks, default_pages(pool.slots, pool.max_rank))
    pool.adopt(
        *page_views(kv_cache, fit, pool.shapes, pool.max_rank, pool.target_modules, pool.dtype, num_runs)
    )
    blocks = UnifiedBlocks(
        num_blocks,
        config.page_size,
        run_blocks=fit.blocks,
        num_runs=num_runs,
        watermark=max(fit.blocks, int(WATERMARK_SHARE * num_blocks)),
        kv_blocks=own,
        prefix_cache=not config.disable_prefix_cache,
    )
    log.info(
        "KV cache and LoRA pages in one budget: %d blocks (%d of them the pool's share: %d pages of %d "
        "blocks, %.1f%% of each run unused); pages take free blocks above a watermark of %d",
        num_blocks,
        share,
        pool.guaranteed_pages,
        fit.blocks,
        100 * fit.waste,
        blocks.watermark,
    )
    return kv_cache, blocks
