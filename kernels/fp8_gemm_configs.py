"""Tile sizes and K-splits of the Triton FP8 GEMMs (kernels/fp8_weight_gemm.py: weight-only and W8A8),
chosen per shape without tuning at first use (Triton's autotuner would time candidates inside a
CUDA-graph capture), and the GEMM `LORAPLEX_FP8_GEMM=auto` takes per shape where one was measured.

A config is keyed on (rows bucket, N, K, kernel): rows bucket 16 / 32 / 64 / 128 / 256 for decode
batches (the bucket is the smallest of those at or above the rows), `prefill` above 256; kernel
`weight_only` or `w8a8`. The weight-only GEMM has tiles for decode up to 64 rows only (it widens every
weight element per row tile, so past 64 rows it runs one prefill config). Entries come from
`LORAPLEX_FP8_GEMM_CONFIGS=path.json` (`loraplex.kernels.settings`), in the
format `{"64|6144|4096": [block_m, block_n, block_k, split_k, num_warps, num_stages],
"64|6144|4096|w8a8": [...], "64|6144|4096|auto": "w8a8"}` (no kernel: `weight_only`; `auto`: the GEMM
`auto` runs for that bucket and weight, one of weight_only, w8a8, scaled_mm), e.g. what
`python -m loraplex.bench.fp8_gemm --sweep-budget-s 120` writes, then the built-in `TABLE` (tiles
measured for the Llama-3.1-8B shapes, and `auto` choices where the rule below was measured wrong;
else kernels/fp8_gemm_choice.py's rule); without a tile entry, `default_config`'s
rule: one rows tile, 64 or 128 weight rows per program, and enough K-splits that the grid covers
the chip about twice (a batch-64 o_proj of the Llama-3.1-8B shape is 32 tiles of 128 rows
otherwise: most of an H100 idle, while the step is weight-bandwidth bound).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from loraplex.kernels.settings import kernel_settings

ROWS_BUCKETS = (16, 32, 64, 128, 256)  # decode buckets; above the last: "prefill"
WEIGHT_ONLY_MAX_ROWS = 64  # the weight-only GEMM's last decode bucket
_DEFAULT_SMS = 132  # H100 SXM; only used where no CUDA device says otherwise (the interpreter)


TRITON_KERNELS = ("weight_only", "w8a8")  # the kernels with tiles here
AUTO_KERNELS = (*TRITON_KERNELS, "scaled_mm")  # what an `auto` entry may name


class Fp8GemmKey(NamedTuple):
    rows: str  # "16" | "32" | "64" | "128" | "256" | "prefill"
    n: int  # output features (the weight's rows)
    k: int  # input features
    kernel: str = "weight_only"  # whose tiles: one of TRITON_KERNELS; "auto" in the choice table


class Fp8GemmConfig(NamedTuple):
    block_m: int  # activation rows per program (>= 16: the MMA's smallest side)
    block_n: int  # weight rows (output features) per program
    block_k: int  # step over K (a block-scaled weight narrows it to divide the scale block)
    split_k: int  # programs over K per tile; > 1 writes float32 partials that a second launch adds
    num_warps: int
    num_stages: int


def rows_bucket(rows: int) -> str:
    for bucket in ROWS_BUCKETS:
        if rows <= bucket:
            return str(bucket)
    return "prefill"


def _parse(raw: dict) -> dict[Fp8GemmKey, Fp8GemmConfig | str]:
    table: dict[Fp8GemmKey, Fp8GemmConfig | str] = {}
    for key, value in raw.items():
        rows, n, k, *kernel = key.split("|")
        if rows not in (*map(str, ROWS_BUCKETS), "prefill"):
            raise ValueError(
                f"FP8 GEMM config key {key!r}: rows bucket must be one of "
                f"{', '.join(map(str, ROWS_BUCKETS))}, prefill"
            )
        kernel = kernel[0] if kernel else "weight_only"
        if kernel == "auto":
            if value not in AUTO_KERNELS:
                raise ValueError(
                    f"FP8 GEMM config {key!r}: {value!r} is not one of {', '.join(AUTO_KERNELS)}"
                )
            table[Fp8GemmKey(rows, int(n), int(k), kernel)] = value
            continue
        if kernel not in TRITON_KERNELS:
            raise ValueError(
                f"FP8 GEMM config key {key!r}: kernel must be one of {', '.join(TRITON_KERNELS)}, auto"
            )
        cfg = Fp8GemmConfig(*(int(v) for v in value))
        if cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < 16 or cfg.split_k < 1:
            raise ValueError(f"FP8 GEMM config {key!r}: {cfg} (blocks >= 16, split_k >= 1)")
        table[Fp8GemmKey(rows, int(n), int(k), kernel)] = cfg
    return table


@lru_cache(maxsize=1)  # read once per path (the setting is read once per process)
def _file_table(path: str | None) -> dict[Fp8GemmKey, Fp8GemmConfig | str]:
    return _parse(json.loads(Path(path).read_text())) if path else {}


# Entries set in-process (the bench's sweep), ahead of the file's: tiles, and `auto` choices.
OVERRIDES: dict[Fp8GemmKey, Fp8GemmConfig | str] = {}

# Built-in entries, after the file's: `python -m loraplex.bench.fp8_gemm --sweep-rows 16,32,64
# --sweep-budget-s 150` on an H100 (2026-12-06), Llama-3.1-8B projections, both Triton kernels; the
# 128 and 256 rows buckets (W8A8 only) and their `auto` choices from `--rows 64,128,192,256
# --sweep-rows 128,256 --sweep-budget-s 170` on an H200 (2026-12-06, docs/benchmarks.md).
TABLE: dict[Fp8GemmKey, Fp8GemmConfig | str] = {
    Fp8GemmKey("16", 6144, 4096): Fp8GemmConfig(16, 64, 64, 4, 4, 4),  # q/k/v
    Fp8GemmKey("16", 4096, 4096): Fp8GemmConfig(16, 64, 64, 6, 4, 4),  # o
    Fp8GemmKey("16", 28672, 4096): Fp8GemmConfig(16, 128, 128, 1, 8, 3),  # gate/up
    Fp8GemmKey("16", 4096, 14336): Fp8GemmConfig(16, 64, 128, 4, 4, 4),  # down
    Fp8GemmKey("32", 6144, 4096): Fp8GemmConfig(32, 64, 128, 4, 4, 3),  # q/k/v
    Fp8GemmKey("32", 4096, 4096): Fp8GemmConfig(32, 64, 128, 4, 4, 3),  # o
    Fp8GemmKey("32", 28672, 4096): Fp8GemmConfig(32, 128, 128, 1, 8, 3),  # gate/up
    Fp8GemmKey("32", 4096, 14336): Fp8GemmConfig(32, 64, 128, 4, 4, 3),  # down
    Fp8GemmKey("64", 6144, 4096): Fp8GemmConfig(64, 64, 128, 2, 4, 3),  # q/k/v
    Fp8GemmKey("64", 4096, 4096): Fp8GemmConfig(64, 64, 128, 4, 4, 3),  # o
    Fp8GemmKey("64", 28672, 4096): Fp8GemmConfig(64, 128, 128, 1, 8, 3),  # gate/up
    Fp8GemmKey("64", 4096, 14336): Fp8GemmConfig(64, 64, 128, 4, 4, 3),  # down
    Fp8GemmKey("16", 6144, 4096, "w8a8"): Fp8GemmConfig(16, 64, 256, 1, 4, 5),  # q/k/v
    Fp8GemmKey("16", 4096, 4096, "w8a8"): Fp8GemmConfig(16, 64, 512, 1, 4, 4),  # o
    Fp8GemmKey("16", 28672, 4096, "w8a8"): Fp8GemmConfig(16, 64, 256, 1, 4, 4),  # gate/up
    Fp8GemmKey("16", 4096, 14336, "w8a8"): Fp8GemmConfig(16, 64, 512, 1, 4, 5),  # down
    Fp8GemmKey("32", 6144, 4096, "w8a8"): Fp8GemmConfig(32, 64, 256, 1, 4, 5),  # q/k/v
    Fp8GemmKey("32", 4096, 4096, "w8a8"): Fp8GemmConfig(32, 64, 256, 1, 4, 6),  # o
    Fp8GemmKey("32", 28672, 4096, "w8a8"): Fp8GemmConfig(32, 128, 256, 1, 8, 4),  # gate/up
    Fp8GemmKey("32", 4096, 14336, "w8a8"): Fp8GemmConfig(32, 64, 512, 1, 4, 4),  # down
    Fp8GemmKey("64", 6144, 4096, "w8a8"): Fp8GemmConfig(64, 64, 256, 1, 4, 5),  # q/k/v
    Fp8GemmKey("64", 4096, 4096, "w8a8"): Fp8GemmConfig(64, 64, 256, 1, 4, 5),  # o
    Fp8GemmKey("64", 28672, 4096, "w8a8"): Fp8GemmConfig(64, 128, 256, 1, 8, 4),  # gate/up
    Fp8GemmKey("64", 4096, 14336, "w8a8"): Fp8GemmConfig(64, 64, 256, 2, 4, 5),  # down
    Fp8GemmKey("128", 6144, 4096, "w8a8"): Fp8GemmConfig(128, 64, 256, 1, 8, 4),  # q/k/v
    Fp8GemmKey("128", 4096, 4096, "w8a8"): Fp8GemmConfig(64, 64, 256, 1, 4, 5),  # o
    Fp8GemmKey("128", 28672, 4096, "w8a8"): Fp8GemmConfig(128, 128, 128, 1, 8, 3),  # gate/up
    Fp8GemmKey("128", 4096, 14336, "w8a8"): Fp8GemmConfig(64, 64, 256, 1, 4, 5),  # down
    Fp8GemmKey("256", 6144, 4096, "w8a8"): Fp8GemmConfig(256, 64, 128, 1, 8, 5),  # q/k/v
    Fp8GemmKey("256", 4096, 4096, "w8a8"): Fp8GemmConfig(128, 64, 256, 1, 8, 4),  # o
    Fp8GemmKey("256", 28672, 4096, "w8a8"): Fp8GemmConfig(256, 64, 128, 1, 8, 5),  # gate/up
    Fp8GemmKey("256", 4096, 14336, "w8a8"): Fp8GemmConfig(128, 64, 256, 1, 8, 4),  # down
    # Where torch._scaled_mm measured faster than the swept W8A8 tiles (activation quantization
    # included in both): the wide gate/up from 128 rows, q/k/v at 256.
    Fp8GemmKey("128", 28672, 4096, "auto"): "scaled_mm",
    Fp8GemmKey("256", 28672, 4096, "auto"): "scaled_mm",
    Fp8GemmKey("256", 6144, 4096, "auto"): "scaled_mm",
}


def table_json(table: dict[Fp8GemmKey, Fp8GemmConfig | str]) -> dict[str, list[int] | str]:
    """The JSON form `LORAPLEX_FP8_GEMM_CONFIGS` reads (a weight-only key without its kernel field)."""
    return {
        "|".join(map(str, key if key.kernel != "weight_only" else key[:3])): (
            value if isinstance(value, str) else list(value)
        )
        for key, value in table.items()
    }


@lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(
    rows: int, n: int, k: int, device: torch.device, kernel: str = "weight_only"
) -> Fp8GemmConfig:
    if rows > (ROWS_BUCKETS[-1] if kernel == "w8a8" else WEIGHT_ONLY_MAX_ROWS):
        return Fp8GemmConfig(block_m=64, block_n=128, block_k=64, split_k=1, num_warps=4, num_stages=3)
    block_m = max(16, 1 << (rows - 1).bit_length())
    if kernel == "w8a8" and rows > WEIGHT_ONLY_MAX_ROWS:
        # What the H200 sweep chose for q/k/v at 128 and 256 rows (2026-12-06): 64 weight rows per
        # program over all of x's rows (each program reads x once, from L2), 8 warps, no K split.
        return Fp8GemmConfig(block_m, 64, 256 if block_m <= 128 else 128, 1, 8, 4 if block_m <= 128 else 5)
    if kernel == "w8a8":
        # What the 64-row sweep chose for every Llama-3.1-8B projection but gate/up (H100, 2026-12-06):
        # deep FP8 K steps and a deep pipeline over 64 weight rows, split in two only for long K.
        return Fp8GemmConfig(block_m, 64, 256, 2 if k >= 8192 else 1, num_warps=4, num_stages=5)
    # Every program re-reads its rows of x (from L2) per weight tile: at 32-64 rows a 64-row weight
    # tile would read twice its own bytes of x, so wider tiles there (and split-K for the grid).
    block_n, block_k, warps = (64, 128, 4) if rows <= 16 else (128, 128, 8)
    tiles = -(-n // block_n) * -(-rows // block_m)
    k_steps = -(-k // block_k)
    # The grid nearest 2 waves, each split keeping at least 4 K steps (the pipeline needs depth).
    split = max(1, min(round(2 * _sm_count(device) / tiles), k_steps // 4))
    return Fp8GemmConfig(block_m, block_n, block_k, split, num_warps=warps, num_stages=4)


def _lookup(key: Fp8GemmKey) -> Fp8GemmConfig | str | None:
    return OVERRIDES.get(key) or _file_table(kernel_settings().fp8_gemm_configs).get(key) or TABLE.get(key)


@lru_cache(maxsize=8)
def max_shared_memory(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on `device` (what Triton checks a launch against);
    None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return driver.active.utils.get_device_properties(index)["max_shared_mem"]
    except (AttributeError, KeyError):  # a Triton without this query: torch's figure, if it has one
        return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def shared_memory_bytes(config: Fp8GemmConfig, kernel: str) -> int:
    """An upper bound on what the pipelined K loop keeps in shared memory: every stage's weight tile
    (E4M3) and x tile (E4M3 for W8A8, bf16/fp16 for weight-only)."""
    x_bytes = 1 if kernel == "w8a8" else 2
    return config.num_stages * config.block_k * (config.block_n + config.block_m * x_bytes)


def fit_shared_memory(config: Fp8GemmConfig, kernel: str, limit: int | None) -> Fp8GemmConfig:
    """`config` with fewer stages (down to 2), then shorter K steps (down to 32), until it fits in
    `limit` bytes: the tables were measured on H100/H200 (227 KB a program), where the deepest
    entries take 200 KB; an Ada GPU (sm_89, FP8 too) allows about 100 KB."""
    if limit is None:
        return config
    while shared_memory_bytes(config, kernel) > limit and config.num_stages > 2:
        config = config._replace(num_stages=config.num_stages - 1)
    while shared_memory_bytes(config, kernel) > limit and config.block_k > 32:
        config = config._replace(block_k=config.block_k // 2)
    return config


def fp8_gemm_config(
    rows: int, n: int, k: int, device: torch.device, kernel: str = "weight_only"
) -> Fp8GemmConfig:
    """The tiles of `kernel` (one of TRITON_KERNELS) for `rows` times a weight `[N, K]`, fitted to
    the device's shared memory."""
    found = _lookup(Fp8GemmKey(rows_bucket(rows), n, k, kernel))
    config = found or default_config(rows, n, k, device, kernel)
    return fit_shared_memory(config, kernel, max_shared_memory(device))


def auto_choice(rows: int, n: int, k: int) -> str | None:
    """The GEMM measured fastest for this rows bucket and weight (an `auto` entry), or None."""
    return _lookup(Fp8GemmKey(rows_bucket(rows), n, k, "auto"))
