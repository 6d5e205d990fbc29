"""Block sizes for the LoRA kernels, per shape family, so no tuning happens at first request.

A step is `decode` (at most DECODE_MAX_TOKENS tokens: small token blocks, split-K shrink
so each adapter's A is streamed by many programs) or `prefill`. Tables are keyed on
(family, hidden size, stacked modules, pool max rank): `d` for shrink, the total output
width for expand; the K-split count on (family, d) alone (plus the upper tier's `decode_many`
rows), so one shrink buffer can serve every group. Entries for Llama-3.1-8B shapes come from
`bench/lora_kernels.py --sweep` on an H200, 2026-12-02, triton 3.6 (docs/benchmarks.md); the rank-16 decode entries and the decode
K-splits from its `--joint-sweep` (one choice for batch 64 over 8 and over 64 adapters, since a
captured graph serves every mix), then adjusted by `bench/decode_sweep.py`, which times candidates
inside the engine's decode graph beside the base matmuls (4 warps for the expands, K step 128 for
the qkv and gate_up shrinks). Other shapes fall back to the rules below. The interpreter
ignores warps and stages.

`LORAPLEX_LORA_CONFIGS=path.json` replaces entries at import (what `bench/lora_kernels.py
--joint-sweep` writes for another GPU or model shape): `{"splits": {"decode|4096": 8},
"shrink": {"decode|4096|3|16": [block_m, block_r, block_k, warps, stages]}, "expand":
{"decode|6144|3|16": [block_m, block_n, chunk_n, warps, stages(, per_token)]}}`. `per_token` 1 picks the
one-program-per-token expand, faster when most decode tokens have their own adapter and slower when
they share (docs/benchmarks.md, rounds 6-7): the `decode_many` expand entries use it, and apply to
decode steps known to carry more than MANY_ADAPTERS distinct adapters (the decode graphs' upper tier),
as do the `decode_many` K-splits (round 8).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DECODE_MAX_TOKENS = 256
# A decode step over more distinct adapters than this uses the `decode_many` entries (the
# per-token kernel: round 6 in docs/benchmarks.md measured it faster over 64 adapters in a batch of
# 64, slower over 8; the crossover between them was not measured).
MANY_ADAPTERS = 16


def many_adapters(max_distinct: int | None) -> bool:
    """Whether a step bounded by `max_distinct` distinct adapters takes the `decode_many` entries
    (None: unknown, so not)."""
    return max_distinct is not None and max_distinct > MANY_ADAPTERS


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
    block_n: int  # output columns per loop step
    chunk_n: int  # output columns per program (a multiple of block_n)
    num_warps: int
    num_stages: int
    # 1: one program per token and column chunk (`_expand_token_kernel`, no tensor-core tile),
    # for decode steps where most tokens have their own adapter.
    per_token: int = 0


def family(num_tokens: int) -> str:
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def splits_bucket(num_tokens: int) -> str:
    """Split-K bucket: few tokens need more splits to spread a few adapters over the chip."""
    return "decode_small" if num_tokens <= 16 else family(num_tokens)


# (splits bucket, d) -> K-splits of shrink (partial sums y[S, T, n*R] that expand adds up)
SPLITS_TABLE: dict[tuple[str, int], int] = {
    ("decode_small", 4096): 8,
    ("decode_small", 14336): 14,
    ("decode", 4096): 8,
    ("decode", 14336): 28,
    # More than MANY_ADAPTERS distinct adapters: an adapter per token fills the grid with half the
    # splits (docs/benchmarks.md round 8: 64 adapters 9.025 -> 8.957 ms in-graph; d 4096 kept at 8).
    ("decode_many", 14336): 14,
    ("prefill", 4096): 2,
    ("prefill", 14336): 4,
}

S, E = ShrinkConfig, ExpandConfig
# (family, d, n_stack, max_rank) -> ShrinkConfig
SHRINK_TABLE: dict[tuple[str, int, int, int], ShrinkConfig] = {
    ("decode", 4096, 3, 16): S(16, 16, 128, 2, 3),  # qkv
    ("decode", 4096, 1, 16): S(16, 16, 128, 2, 3),  # o
    ("decode", 4096, 2, 16): S(16, 16, 128, 2, 3),  # gate_up
    ("decode", 14336, 1, 16): S(16, 16, 128, 2, 3),  # down
    ("prefill", 4096, 3, 16): S(64, 16, 128, 8, 3),  # qkv
    ("prefill", 4096, 1, 16): S(32, 16, 128, 4, 3),  # o
    ("prefill", 4096, 2, 16): S(32, 16, 128, 4, 3),  # gate_up
    ("prefill", 14336, 1, 16): S(32, 16, 128, 4, 3),  # down
    ("decode", 4096, 3, 64): S(16, 32, 128, 4, 4),  # qkv
    ("decode", 4096, 1, 64): S(16, 32, 128, 4, 4),  # o
    ("decode", 4096, 2, 64): S(16, 32, 128, 4, 4),  # gate_up
    ("decode", 14336, 1, 64): S(16, 32, 512, 4, 3),  # down
    ("prefill", 4096, 3, 64): S(64, 64, 64, 4, 3),  # qkv
    ("prefill", 4096, 1, 64): S(64, 64, 128, 8, 3),  # o
    ("prefill", 4096, 2, 64): S(64, 64, 128, 8, 3),  # gate_up
    ("prefill", 14336, 1, 64): S(64, 64, 128, 8, 3),  # down
}

# (family, total output width, n_stack, max_rank) -> ExpandConfig
EXPAND_TABLE: dict[tuple[str, int, int, int], ExpandConfig] = {
    ("decode", 6144, 3, 16): E(16, 128, 256, 4, 3),  # qkv
    ("decode", 4096, 1, 16): E(16, 128, 256, 4, 3),  # o, down
    ("decode", 28672, 2, 16): E(16, 64, 256, 4, 3),  # gate_up
    ("decode_many", 6144, 3, 16): E(16, 512, 512, 4, 3, 1),  # qkv, per-token kernel
    ("decode_many", 4096, 1, 16): E(16, 512, 512, 4, 3, 1),  # o, down
    ("decode_many", 28672, 2, 16): E(16, 512, 512, 4, 3, 1),  # gate_up
    ("prefill", 6144, 3, 16): E(64, 128, 1024, 4, 3),  # qkv
    ("prefill", 4096, 1, 16): E(32, 256, 512, 4, 3),  # o, down
    ("prefill", 28672, 2, 16): E(64, 128, 512, 4, 3),  # gate_up
    ("decode", 6144, 3, 64): E(16, 128, 1024, 8, 3),  # qkv
    ("decode", 4096, 1, 64): E(16, 256, 1024, 8, 3),  # o, down
    ("decode", 28672, 2, 64): E(16, 128, 1024, 4, 3),  # gate_up
    ("prefill", 6144, 3, 64): E(64, 128, 512, 4, 3),  # qkv
    ("prefill", 4096, 1, 64): E(64, 128, 1024, 4, 3),  # o, down
    ("prefill", 28672, 2, 64): E(64, 128, 1024, 4, 3),  # gate_up
}
del S, E


def _key(text: str) -> tuple:
    return tuple(part if not part.isdigit() else int(part) for part in text.split("|"))


def load_overrides(path: str) -> None:
    """Merge a JSON file of table entries (format in the module docstring) into the tables."""
    data = json.loads(Path(path).read_text())
    SPLITS_TABLE.update({_key(k): int(v) for k, v in data.get("splits", {}).items()})
    SHRINK_TABLE.update({_key(k): ShrinkConfig(*v) for k, v in data.get("shrink", {}).items()})
    EXPAND_TABLE.update({_key(k): ExpandConfig(*v) for k, v in data.get("expand", {}).items()})
    for fn in (shrink_splits, shrink_config, expand_config):
        fn.cache_clear()


def _rank_bucket(max_rank: int) -> int:
    return 16 if max_rank <= 16 else 64


@lru_cache(maxsize=1024)
def shrink_splits(d: int, num_tokens: int, many: bool = False) -> int:
    """How many partial sums `lora_shrink` writes for this `d` (the first dim of its `y`).
    `many`: more than MANY_ADAPTERS distinct adapters (`decode_many` entries, where the table has
    them: with an adapter per token the grid is wide without splitting K as far)."""
    bucket = splits_bucket(num_tokens)
    if many and bucket == "decode" and ("decode_many", d) in SPLITS_TABLE:
        return SPLITS_TABLE[("decode_many", d)]
    if (bucket, d) in SPLITS_TABLE:
        return SPLITS_TABLE[(bucket, d)]
    if bucket == "decode_small":
        return max(1, min(16, d // 512))
    return max(1, min(8 if bucket == "decode" else 4, d // 2048))


@lru_cache(maxsize=1024)
def shrink_config(d: int, n_stack: int, max_rank: int, num_tokens: int) -> ShrinkConfig:
    fam = family(num_tokens)
    hit = SHRINK_TABLE.get((fam, d, n_stack, max_rank)) or SHRINK_TABLE.get(
        (fam, d, n_stack, _rank_bucket(max_rank))
    )
    if hit is not None:
        return hit
    block_r = 16 if max_rank <= 16 else 32
    if fam == "decode":
        return ShrinkConfig(16, block_r, 256, 4, 3)
    return ShrinkConfig(64, max(16, min(64, max_rank)), 64, 4, 3)


@lru_cache(maxsize=1024)
def expand_config(
    width: int, n_stack: int, max_rank: int, num_tokens: int, many: bool = False
) -> ExpandConfig:
    """`many`: the step has more than MANY_ADAPTERS distinct adapters (decode_many entries, where
    the table has them)."""
    fam = family(num_tokens)
    if many and fam == "decode":
        hit = EXPAND_TABLE.get(("decode_many", width, n_stack, max_rank))
        if hit is not None:
            return hit
    hit = EXPAND_TABLE.get((fam, width, n_stack, max_rank)) or EXPAND_TABLE.get(
        (fam, width, n_stack, _rank_bucket(max_rank))
    )
    if hit is not None:
        return hit
    if fam == "decode":
        return ExpandConfig(16, 256, 1024, 4, 2)
    return ExpandConfig(64, 128, 512, 4, 2)


if os.environ.get("LORAPLEX_LORA_CONFIGS"):
    load_overrides(os.environ["LORAPLEX_LORA_CONFIGS"])
