"""Paged KV cache bookkeeping: fixed-size blocks handed out to per-request block tables."""

from __future__ import annotations


class BlockManager:
    """Owns the free list of KV blocks. Block tables are plain lists owned by requests."""

    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.page_size = page_size
        # Pop from the end: low block ids first, which keeps small runs compact.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def max_tokens(self, block_table: list[int]) -> int:
        """How many tokens this table could cover if it took every free block now."""
        return (len(block_table) + len(self._free)) * self.page_size

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it covers `num_tokens` tokens."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {need} blocks, {len(self._free)} free")
        for _ in range(max(need, 0)):
            block_table.append(self._free.pop())

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
