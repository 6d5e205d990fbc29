"""Paged KV cache bookkeeping: fixed-size blocks handed out to per-request block tables.

With the prefix cache on, a full block whose KV is computed may be *registered* under its block
key (engine/prefix_cache.py). A registered block stays indexed after its last request lets go of
it: it is then *evictable*, still counted as free, and handed out again (unindexed, LRU first)
only when no never-cached block is left. A block some request holds (refcount > 0) is never
evicted, and a request that reuses a cached block takes one more reference on it.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    """Owns the free list and refcounts of KV blocks. Block tables are plain lists owned by requests."""

    def __init__(self, num_blocks: int, page_size: int, *, prefix_cache: bool = False):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        # Pop from the end: low block ids first, which keeps small runs compact.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._index: dict[bytes, int] = {}  # block key -> block holding that KV
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0; LRU first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held by a request or evictable."""
        return len(self._key_of)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def refcount(self, block: int) -> int:
        """Requests holding `block` (0: free, or cached and evictable)."""
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def max_tokens(self, block_table: list[int], reuse: list[int] = ()) -> int:
        """How many tokens this table could cover if it took the cached blocks `reuse` (see
        `match`) and then every free block."""
        taken_from_free = sum(1 for b in reuse if self._refs[b] == 0)
        return (len(block_table) + len(reuse) + self.num_free_blocks - taken_from_free) * self.page_size

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free_blocks

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it covers `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV cache exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            block_table.append(self._take_free())

    def free(self, block_table: list[int]) -> None:
        """Drop the table's references. The last block goes first, so a request's tail is evicted
        before its prefix, which other requests are likelier to share."""
        for block in reversed(block_table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        block_table.clear()

    # -- the prefix cache -----------------------------------------------------------------

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached blocks holding the longest run of `keys` from the first (nothing is taken)."""
        if not self.prefix_cache:
            return []
        out = []
        for key in keys:
            block = self._index.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def reuse(self, block_table: list[int], blocks: list[int]) -> None:
        """Append cached `blocks` (from `match`, this step) to an empty table, one reference each."""
        assert not block_table, "cached blocks start a table"
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            block_table.append(block)

    def register(self, key: bytes, block: int) -> None:
        """Index a full block whose KV is computed. A key already indexed keeps its block (two
        requests computed the same block side by side; the second copy stays private)."""
        if self.prefix_cache and key not in self._index and block not in self._key_of:
            self._index[key] = block
            self._key_of[block] = key

    def reset_prefix_cache(self, enabled: bool) -> None:
        """Forget every cached block and turn caching on or off (benchmarks compare both on one
        engine). Evictable blocks become plain free blocks; blocks requests hold stay theirs."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._index.clear()
        self._key_of.clear()
        self.prefix_cache = enabled

    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._key_of.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block
