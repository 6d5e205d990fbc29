"""Block sizes for the LoRA kernels, per shape family, so no tuning happens at first request.

Keys are the hidden size (input `d` of shrink, total output width of expand), the pool's
max rank and the step's token count. Entries were picked on an H200 with
`bench/lora_kernels.py` (see docs/benchmarks.md); the interpreter ignores warps/stages.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps with at most this many tokens are treated as decode-like (small token blocks,
# split-K shrink); larger ones as prefill-like (large token blocks, tensor-core tiles).
DECODE_MAX_TOKENS = 256


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # tokens per program (one of lora_meta.BLOCK_MS)
    block_r: int  # rank rows per program (programs past a slot's rank exit)
    block_k: int  # step over d
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int  # tokens per program (one of lora_meta.BLOCK_MS)
    block_n: int  # output columns per program
    block_k: int  # step over the rank (runtime bound: a slot's real rank)
    num_warps: int
    num_stages: int


def shrink_splits(d: int, num_tokens: int) -> int:
    """How many K-splits (over `d`) shrink uses; its output buffer has this many partials.

    Decode reads each adapter's A once: split-K spreads those bytes over many programs so
    the whole chip streams them. Prefill has enough token blocks to fill the chip alone.
    """
    if num_tokens <= DECODE_MAX_TOKENS:
        return max(1, min(16, d // 1024))
    if num_tokens <= 1024:
        return max(1, min(4, d // 2048))
    return 1


def shrink_config(d: int, max_rank: int, num_tokens: int) -> ShrinkConfig:
    block_r = 16 if max_rank <= 16 else 32
    if num_tokens <= DECODE_MAX_TOKENS:
        return ShrinkConfig(block_m=16, block_r=block_r, block_k=256, num_warps=4, num_stages=3)
    return ShrinkConfig(block_m=64, block_r=max(16, min(64, max_rank)), block_k=64, num_warps=4, num_stages=3)


def expand_config(width: int, max_rank: int, num_tokens: int) -> ExpandConfig:
    block_k = 16 if max_rank <= 16 else 32
    if num_tokens <= DECODE_MAX_TOKENS:
        return ExpandConfig(block_m=16, block_n=256, block_k=block_k, num_warps=4, num_stages=2)
    return ExpandConfig(block_m=64, block_n=128, block_k=block_k, num_warps=4, num_stages=2)
