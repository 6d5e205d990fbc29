"""Block sizes and K-splits for the LoRA kernels, per shape family, so no tuning happens at first request.

A step is `decode` (at most DECODE_MAX_TOKENS tokens: small token blocks, split-K shrink so each
adapter's A is streamed by many programs) or `prefill`. Block sizes are keyed on (family, input or
output width, stacked modules, pool max rank): the input width `d` for shrink, the total output width
for expand. K-splits are keyed on (splits bucket, d) alone, so one shrink buffer serves every group.
The per-step choice among these entries is made once, by `loraplex.kernels.lora_plan.plan_step`.

Decode steps over more than MANY_ADAPTERS distinct adapters (the decode graphs' upper tier) take the
`decode_many` entries where the table has them: the expand with one program per token and column
chunk (`per_token=1`), faster when most tokens have their own adapter and slower when they share,
and fewer K-splits for d 14336 (an adapter per token fills the grid without splitting K as far).

The Llama-3.1-8B entries come from `python -m loraplex.bench.lora_kernels --sweep` and `--joint-sweep`
on an H200 with triton 3.6 (one choice for batch 64 over 8 and over 64 adapters, since a captured graph serves
every mix), adjusted by `python -m loraplex.bench.decode_sweep`, which times candidates inside the engine's
decode graph beside the base matmuls; measurements in docs/benchmarks.md. Other shapes fall back to the
rules in `shrink_splits` / `shrink_config` / `expand_config`. The interpreter ignores warps and stages.

`LORAPLEX_LORA_CONFIGS=path.json` (`loraplex.kernels.settings`) replaces entries at import, in the format
`{"splits": {"decode|4096": 8}, "shrink": {"decode|4096|3|16": [block_m, block_r, block_k, num_warps,
num_stages]}, "expand": {"decode|6144|3|16": [block_m, block_n, chunk_n, num_warps, num_stages(,
per_token)]}}` (keys: the key tuples' fields joined by `|`; values: the config fields in order).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from loraplex.kernels.settings import kernel_settings

DECODE_MAX_TOKENS = 256
# A decode step over more distinct adapters than this uses the `decode_many` entries (measured faster
# over 64 adapters in a batch of 64, slower over 8; the crossover between them was not measured).
MANY_ADAPTERS = 16


class ShrinkConfig(NamedTuple):
    block_m: int  # tokens per program (one of lora_meta.BLOCK_MS)
    block_r: int  # rank rows per program (programs past a slot's rank exit)
    block_k: int  # step over d
    num_warps: int
    num_stages: int


class ExpandConfig(NamedTuple):
    block_m: int  # tokens per program (one of lora_meta.BLOCK_MS)
    block_n: int  # output columns per loop step
    chunk_n: int  # output columns per program (a multiple of block_n)
    num_warps: int
    num_stages: int
    # 1: one program per token and column chunk (`_expand_token_kernel`, no tensor-core tile),
    # for decode steps where most tokens have their own adapter.
    per_token: int = 0


class SplitsKey(NamedTuple):
    bucket: str  # splits_bucket(): decode_small | decode | decode_many | prefill
    in_features: int  # d, the shrink's K


class ShrinkKey(NamedTuple):
    family: str  # family(): decode | prefill
    in_features: int  # d
    n_stack: int  # stacked modules of the group
    max_rank: int  # the pool's max rank (or its bucket, 16 or 64)


class ExpandKey(NamedTuple):
    family: str  # decode | decode_many | prefill
    out_features: int  # sum of the stacked modules' output widths
    n_stack: int
    max_rank: int


def family(num_tokens: int) -> str:
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def splits_bucket(num_tokens: int) -> str:
    """Split-K bucket: few tokens need more splits to spread a few adapters over the chip."""
    return "decode_small" if num_tokens <= 16 else family(num_tokens)


# K-splits of shrink: partial sums y[splits, T, n*R] that expand adds up.
SPLITS_TABLE: dict[SplitsKey, int] = {
    SplitsKey("decode_small", in_features=4096): 8,
    SplitsKey("decode_small", in_features=14336): 14,
    SplitsKey("decode", in_features=4096): 8,
    SplitsKey("decode", in_features=14336): 28,
    # Over many adapters half the splits fill the grid; d 4096 keeps the decode entry (fewer splits
    # there changed the bf16 logits beyond the sweep's bound: docs/benchmarks.md).
    SplitsKey("decode_many", in_features=14336): 14,
    SplitsKey("prefill", in_features=4096): 2,
    SplitsKey("prefill", in_features=14336): 4,
}


def _s(block_m: int, block_r: int, block_k: int, num_warps: int, num_stages: int) -> ShrinkConfig:
    return ShrinkConfig(
        block_m=block_m, block_r=block_r, block_k=block_k, num_warps=num_warps, num_stages=num_stages
    )


def _e(
    block_m: int, block_n: int, chunk_n: int, num_warps: int, num_stages: int, per_token: int = 0
) -> ExpandConfig:
    return ExpandConfig(
        block_m=block_m,
        block_n=block_n,
        chunk_n=chunk_n,
        num_warps=num_warps,
        num_stages=num_stages,
        per_token=per_token,
    )


# Entries that several keys share.
_DECODE_R16 = _s(block_m=16, block_r=16, block_k=128, num_warps=2, num_stages=3)
_PREFILL_R16 = _s(block_m=32, block_r=16, block_k=128, num_warps=4, num_stages=3)
_DECODE_R64 = _s(block_m=16, block_r=32, block_k=128, num_warps=4, num_stages=4)
_PREFILL_R64 = _s(block_m=64, block_r=64, block_k=128, num_warps=8, num_stages=3)
_PER_TOKEN = _e(block_m=16, block_n=512, chunk_n=512, num_warps=4, num_stages=3, per_token=1)

SHRINK_TABLE: dict[ShrinkKey, ShrinkConfig] = {
    ShrinkKey("decode", in_features=4096, n_stack=3, max_rank=16): _DECODE_R16,  # qkv
    ShrinkKey("decode", in_features=4096, n_stack=1, max_rank=16): _DECODE_R16,  # o
    ShrinkKey("decode", in_features=4096, n_stack=2, max_rank=16): _DECODE_R16,  # gate_up
    ShrinkKey("decode", in_features=14336, n_stack=1, max_rank=16): _DECODE_R16,  # down
    ShrinkKey("prefill", in_features=4096, n_stack=3, max_rank=16): _s(
        block_m=64, block_r=16, block_k=128, num_warps=8, num_stages=3
    ),  # qkv
    ShrinkKey("prefill", in_features=4096, n_stack=1, max_rank=16): _PREFILL_R16,  # o
    ShrinkKey("prefill", in_features=4096, n_stack=2, max_rank=16): _PREFILL_R16,  # gate_up
    ShrinkKey("prefill", in_features=14336, n_stack=1, max_rank=16): _PREFILL_R16,  # down
    ShrinkKey("decode", in_features=4096, n_stack=3, max_rank=64): _DECODE_R64,  # qkv
    ShrinkKey("decode", in_features=4096, n_stack=1, max_rank=64): _DECODE_R64,  # o
    ShrinkKey("decode", in_features=4096, n_stack=2, max_rank=64): _DECODE_R64,  # gate_up
    ShrinkKey("decode", in_features=14336, n_stack=1, max_rank=64): _s(
        block_m=16, block_r=32, block_k=512, num_warps=4, num_stages=3
    ),  # down
    ShrinkKey("prefill", in_features=4096, n_stack=3, max_rank=64): _s(
        block_m=64, block_r=64, block_k=64, num_warps=4, num_stages=3
    ),  # qkv
    ShrinkKey("prefill", in_features=4096, n_stack=1, max_rank=64): _PREFILL_R64,  # o
    ShrinkKey("prefill", in_features=4096, n_stack=2, max_rank=64): _PREFILL_R64,  # gate_up
    ShrinkKey("prefill", in_features=14336, n_stack=1, max_rank=64): _PREFILL_R64,  # down
}

# Output widths: qkv 6144 (GQA), o and down 4096 (one entry serves both), gate_up 28672.
EXPAND_TABLE: dict[ExpandKey, ExpandConfig] = {
    ExpandKey("decode", out_features=6144, n_stack=3, max_rank=16): _e(
        block_m=16, block_n=128, chunk_n=256, num_warps=4, num_stages=3
    ),
    ExpandKey("decode", out_features=4096, n_stack=1, max_rank=16): _e(
        block_m=16, block_n=128, chunk_n=256, num_warps=4, num_stages=3
    ),
    ExpandKey("decode", out_features=28672, n_stack=2, max_rank=16): _e(
        block_m=16, block_n=64, chunk_n=256, num_warps=4, num_stages=3
    ),
    ExpandKey("decode_many", out_features=6144, n_stack=3, max_rank=16): _PER_TOKEN,
    ExpandKey("decode_many", out_features=4096, n_stack=1, max_rank=16): _PER_TOKEN,
    ExpandKey("decode_many", out_features=28672, n_stack=2, max_rank=16): _PER_TOKEN,
    ExpandKey("prefill", out_features=6144, n_stack=3, max_rank=16): _e(
        block_m=64, block_n=128, chunk_n=1024, num_warps=4, num_stages=3
    ),
    ExpandKey("prefill", out_features=4096, n_stack=1, max_rank=16): _e(
        block_m=32, block_n=256, chunk_n=512, num_warps=4, num_stages=3
    ),
    ExpandKey("prefill", out_features=28672, n_stack=2, max_rank=16): _e(
        block_m=64, block_n=128, chunk_n=512, num_warps=4, num_stages=3
    ),
    ExpandKey("decode", out_features=6144, n_stack=3, max_rank=64): _e(
        block_m=16, block_n=128, chunk_n=1024, num_warps=8, num_stages=3
    ),
    ExpandKey("decode", out_features=4096, n_stack=1, max_rank=64): _e(
        block_m=16, block_n=256, chunk_n=1024, num_warps=8, num_stages=3
    ),
    ExpandKey("decode", out_features=28672, n_stack=2, max_rank=64): _e(
        block_m=16, block_n=128, chunk_n=1024, num_warps=4, num_stages=3
    ),
    ExpandKey("prefill", out_features=6144, n_stack=3, max_rank=64): _e(
        block_m=64, block_n=128, chunk_n=512, num_warps=4, num_stages=3
    ),
    ExpandKey("prefill", out_features=4096, n_stack=1, max_rank=64): _e(
        block_m=64, block_n=128, chunk_n=1024, num_warps=4, num_stages=3
    ),
    ExpandKey("prefill", out_features=28672, n_stack=2, max_rank=64): _e(
        block_m=64, block_n=128, chunk_n=1024, num_warps=4, num_stages=3
    ),
}


def _key(text: str) -> tuple:
    """A table key from its JSON form (`decode|4096|3|16`)."""
    return tuple(part if not part.isdigit() else int(part) for part in text.split("|"))


def load_overrides(path: str) -> None:
    """Merge a JSON file of table entries (format in the module docstring) into the tables."""
    data = json.loads(Path(path).read_text())
    unknown = sorted(set(data) - {"splits", "shrink", "expand"})
    if unknown:  # a misspelt table, or "fused" from before that kernel was removed: never ignored
        raise ValueError(
            f"LORAPLEX_LORA_CONFIGS={path}: unknown tables {unknown}; expected splits, shrink, expand"
        )
    SPLITS_TABLE.update({SplitsKey(*_key(k)): int(v) for k, v in data.get("splits", {}).items()})
    SHRINK_TABLE.update({ShrinkKey(*_key(k)): ShrinkConfig(*v) for k, v in data.get("shrink", {}).items()})
    EXPAND_TABLE.update({ExpandKey(*_key(k)): ExpandConfig(*v) for k, v in data.get("expand", {}).items()})
    clear_caches()


def clear_caches() -> None:
    """Forget cached lookups: call after changing a table in place (`load_overrides` does)."""
    for fn in (shrink_splits, shrink_config, expand_config):
        fn.cache_clear()


def _rank_bucket(max_rank: int) -> int:
    return 16 if max_rank <= 16 else 64


@lru_cache(maxsize=1024)
def shrink_splits(d: int, num_tokens: int, many: bool = False) -> int:
    """How many partial sums `lora_shrink` writes for this `d` (the first dim of its `y`).
    `many`: the step has more than MANY_ADAPTERS distinct adapters (`decode_many` entries, where the
    table has them)."""
    bucket = splits_bucket(num_tokens)
    if many and bucket == "decode":
        hit = SPLITS_TABLE.get(SplitsKey("decode_many", d))
        if hit is not None:
            return hit
    hit = SPLITS_TABLE.get(SplitsKey(bucket, d))
    if hit is not None:
        return hit
    if bucket == "decode_small":
        return max(1, min(16, d // 512))
    return max(1, min(8 if bucket == "decode" else 4, d // 2048))


@lru_cache(maxsize=1024)
def shrink_config(d: int, n_stack: int, max_rank: int, num_tokens: int) -> ShrinkConfig:
    fam = family(num_tokens)
    hit = SHRINK_TABLE.get(ShrinkKey(fam, d, n_stack, max_rank)) or SHRINK_TABLE.get(
        ShrinkKey(fam, d, n_stack, _rank_bucket(max_rank))
    )
    if hit is not None:
        return hit
    block_r = 16 if max_rank <= 16 else 32
    if fam == "decode":
        return _s(block_m=16, block_r=block_r, block_k=256, num_warps=4, num_stages=3)
    return _s(block_m=64, block_r=max(16, min(64, max_rank)), block_k=64, num_warps=4, num_stages=3)


@lru_cache(maxsize=1024)
def expand_config(
    width: int, n_stack: int, max_rank: int, num_tokens: int, many: bool = False
) -> ExpandConfig:
    """`many`: the step has more than MANY_ADAPTERS distinct adapters (`decode_many` entries, where
    the table has them)."""
    fam = family(num_tokens)
    if many and fam == "decode":
        hit = EXPAND_TABLE.get(ExpandKey("decode_many", width, n_stack, max_rank))
        if hit is not None:
            return hit
    hit = EXPAND_TABLE.get(ExpandKey(fam, width, n_stack, max_rank)) or EXPAND_TABLE.get(
        ExpandKey(fam, width, n_stack, _rank_bucket(max_rank))
    )
    if hit is not None:
        return hit
    if fam == "decode":
        return _e(block_m=16, block_n=256, chunk_n=1024, num_warps=4, num_stages=2)
    return _e(block_m=64, block_n=128, chunk_n=512, num_warps=4, num_stages=2)


def apply_settings() -> None:
    """Load the overrides file named by the kernel settings, if any (done once at import)."""
    path = kernel_settings().lora_configs
    if path:
        load_overrides(path)


apply_settings()
