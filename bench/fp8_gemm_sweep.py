"""Pieces of bench/fp8_gemm.py: the Triton FP8 GEMMs it times, CUDA-graph timing over copies of the
weights that no L2 holds, and the budgeted sweep of both Triton GEMMs' tiles and K-splits."""

from __future__ import annotations

import random
import time

import torch

from loraplex.kernels.fp8_gemm_configs import (
    WEIGHT_ONLY_MAX_ROWS,
    Fp8GemmConfig,
    Fp8GemmKey,
    fp8_gemm_config,
    rows_bucket,
    shared_memory_bytes,
)
from loraplex.kernels.fp8_weight_gemm import fp8_w8a8_gemm, fp8_weight_gemm

COPY_BYTES = 256 << 20  # weights cycled per timed graph: several times any L2

GEMMS = {"weight_only": fp8_weight_gemm, "w8a8": fp8_w8a8_gemm}


def copies_of(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    nbytes = sum(t.nbytes for t in tensors)
    count = min(64, max(2, -(-COPY_BYTES // nbytes)))  # (tiny shapes stay in L2 regardless)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def graph_us(call, sets: list[tuple[torch.Tensor, ...]], replays: int = 10) -> float:
    """Median microseconds per call over one CUDA graph calling `call(*s)` for each weight set."""
    from loraplex.bench.graph_timing import capture, replay_ms

    graph = capture(lambda: [call(*s) for s in sets])
    times = sorted(replay_ms(graph, replays))
    del graph
    return times[len(times) // 2] * 1e3 / len(sets)


def candidates(rows: int, k: int, seed: int, kernel: str = "weight_only") -> list[Fp8GemmConfig]:
    """Tiles and K-splits at 4 stages (8 warps for 128+ weight rows or a large accumulator, else 4),
    shuffled. The W8A8 GEMM keeps both operands in FP8 (half the bytes of a widened tile), so it also
    tries 512-deep K steps, and above 64 rows rows tiles of 64 and 128 as well as one over all rows."""
    whole = max(16, 1 << (rows - 1).bit_length())
    w8a8 = kernel == "w8a8"
    block_ms = (whole,) if rows <= WEIGHT_ONLY_MAX_ROWS else (64, 128, whole) if w8a8 else (64,)
    first = []
    for block_m in sorted(set(block_ms)):
        for block_n in (32, 64, 128, 256):
            for block_k in (64, 128, 256, 512) if w8a8 else (64, 128, 256):
                for split in (1, 2, 3, 4, 6, 8, 12, 16):
                    if k // block_k // split < 2 or block_n * block_k > 256 * (256 if w8a8 else 128):
                        continue
                    warps = 8 if block_n >= 128 or block_n * block_m >= 64 * 128 else 4
                    cfg = Fp8GemmConfig(block_m, block_n, block_k, split, warps, 4)
                    # Both operands' 4 stages in shared memory; the float32 accumulator in registers.
                    if shared_memory_bytes(cfg, kernel) > 200 * 1024 or block_n * block_m > 128 * 128:
                        continue
                    first.append(cfg)
    random.Random(seed).shuffle(first)
    return first


def sweep(projections: dict, ops_by: dict, rows_list: list[int], budget_s: float) -> dict:
    """Best config per (rows bucket, n, k, Triton kernel) within the budget: first a shuffled pass
    over tiles and K-splits at 4 stages (8 warps for 128+ weight rows, else 4), round-robin over the
    shapes and kernels, then warps and stages around each one's best. Candidates that do not compile
    or run (shared memory) are skipped."""
    deadline = time.perf_counter() + budget_s
    best: dict[Fp8GemmKey, tuple[float, Fp8GemmConfig]] = {}
    queues = []
    for rows in rows_list:
        for name, (n, k) in projections.items():
            for kernel in GEMMS:
                if kernel == "weight_only" and rows > WEIGHT_ONLY_MAX_ROWS:
                    continue  # one prefill config there (kernels/fp8_gemm_configs.py)
                key = Fp8GemmKey(rows_bucket(rows), n, k, kernel)
                default = fp8_gemm_config(rows, n, k, ops_by[name]["wq"].device, kernel)
                queues.append((rows, name, key, [default, *candidates(rows, k, n + k, kernel)]))
    tried = 0

    def run(rows, name, key, cfg) -> None:
        nonlocal tried
        ops = ops_by[name]
        x = torch.randn(rows, ops["wq"].shape[1], device=ops["wq"].device, dtype=torch.bfloat16)
        gemm = GEMMS[key.kernel]
        try:
            us = graph_us(lambda wq, ws: gemm(x, wq, ws, None, None, cfg), ops["sets"])
        except Exception as exc:  # noqa: BLE001 - out of shared memory and the like: not a candidate
            print(f"  sweep {name} rows {rows} {tuple(cfg)}: skipped ({type(exc).__name__})", flush=True)
            return
        tried += 1
        if key not in best or us < best[key][0]:
            best[key] = (us, cfg)

    while any(q[3] for q in queues) and time.perf_counter() < deadline:
        for rows, name, key, queue in queues:
            if queue and time.perf_counter() < deadline:
                run(rows, name, key, queue.pop(0))
    for rows, name, key, _ in queues:
        if key in best and time.perf_counter() < deadline:
            base = best[key][1]
            for warps, stages in ((4, 3), (4, 5), (4, 6), (8, 3), (8, 4), (8, 5), (2, 4)):
                if time.perf_counter() < deadline:
                    run(rows, name, key, base._replace(num_warps=warps, num_stages=stages))
    print(
        f"sweep: {tried} configs timed in {budget_s - max(0.0, deadline - time.perf_counter()):.0f} s",
        flush=True,
    )
    return {key: cfg for key, (_, cfg) in best.items()}
