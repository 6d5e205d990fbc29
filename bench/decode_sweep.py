"""Decode LoRA launch configurations timed inside the engine's batch-64 decode graph, where the LoRA
kernels share the GPU with the base matmuls (bench/lora_kernels.py times them alone).

    PYTHONPATH=protos python3 -m loraplex.bench.decode_sweep [--adapters 64] [--out DIR]

Each candidate replaces entries of the tables in kernels/lora_configs.py (`load_overrides`); the
batch-64 LoRA graph is recaptured and timed with the step's token slots over 8 and over 64 adapters
(GPU ms per replay: 20 back-to-back replays, median of 5), beside the base graph. Single changes
first, then the best of each kind together. Prints a table; writes decode_sweep.json and the best
candidate's entries as lora_configs.json (loadable with LORAPLEX_LORA_CONFIGS) to --out DIR.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from pathlib import Path

import torch

from loraplex.bench.profile_step import bench_args, bench_engine, start_batch
from loraplex.bench.results import write_json
from loraplex.kernels import lora_configs as cfg

R16 = {"qkv": "decode|6144|3|16", "o_down": "decode|4096|1|16", "gate_up": "decode|28672|2|16"}
SHRINK16 = {
    "qkv": "decode|4096|3|16",
    "o": "decode|4096|1|16",
    "gate_up": "decode|4096|2|16",
    "down": "decode|14336|1|16",
}


def gpu_ms(graph: torch.cuda.CUDAGraph, n: int = 20, reps: int = 5) -> float:
    """Median GPU ms per replay over back-to-back replays (the launch of the next overlaps the GPU)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def entries(kind: str, key: str) -> list[int]:
    table = cfg.EXPAND_TABLE if kind == "expand" else cfg.SHRINK_TABLE
    c = table[cfg._key(key)]
    return list(c)


def expand_with(**changes: int) -> dict:
    names = ["block_m", "block_n", "chunk_n", "num_warps", "num_stages", "per_token"]
    out = {}
    for key in R16.values():
        row = entries("expand", key)
        for name, value in changes.items():
            row[names.index(name)] = value
        row[2] = max(row[2], row[1])  # chunk_n is a multiple of block_n
        out[key] = row
    return {"expand": out}


def shrink_with(groups: tuple[str, ...], **changes: int) -> dict:
    names = ["block_m", "block_r", "block_k", "num_warps", "num_stages"]
    out = {}
    for g in groups:
        row = entries("shrink", SHRINK16[g])
        for name, value in changes.items():
            row[names.index(name)] = value
        out[SHRINK16[g]] = row
    return {"shrink": out}


def candidates() -> dict[str, dict]:
    """Single changes around the current table (docs/benchmarks.md has the sweeps behind it). The
    graphs of more than MANY_ADAPTERS distinct adapters (`decode_many` entries) use the per-token
    expand kernel; the second candidate puts the segment kernel back there: same logits, and the
    time it costs."""
    many = {key: key.replace("decode|", "decode_many|") for key in R16.values()}  # decode key -> upper tier's
    return {
        "current table": {},
        "segment kernel for > 16 adapters": {"expand": {m: entries("expand", k) for k, m in many.items()}},
        "per-token block_n 256, 2 warps": {"expand": {m: [16, 256, 256, 2, 3, 1] for m in many.values()}},
        "per-token block_n 1024": {"expand": {m: [16, 1024, 1024, 4, 3, 1] for m in many.values()}},
        # Upper-tier K-splits of shrink (the decode tier's: 8 for d 4096, 28 for 14336): with an
        # adapter per token the grid is wide enough with fewer, and fewer leave SMs to the matmul.
        **{f"splits >16 adapters d14336 {n}": {"splits": {"decode_many|14336": n}} for n in (7, 14)},
        **{f"splits >16 adapters d4096 {n}": {"splits": {"decode_many|4096": n}} for n in (2, 4)},
        **{
            f"splits >16 adapters d14336 {a}, d4096 {b}": {
                "splits": {"decode_many|14336": a, "decode_many|4096": b}
            }
            for a, b in ((14, 4), (7, 2))
        },
    }


def merge(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for kind, rows in part.items():
            out.setdefault(kind, {}).update(rows)
    return out


def main() -> int:
    opts = bench_args(__doc__)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    async_engine, names, prompts = bench_engine(opts.adapters, Path(opts.work))
    engine = async_engine.engine
    graphs, backend = engine.runner.cuda_graphs, engine.runner.lora_backend
    start_batch(engine, prompts, names, min(64, len(names)))
    slots64 = graphs.token_slots[:64].clone()
    slots8 = slots64[torch.arange(64, device=slots64.device) % 8]
    key8, key64, base_key = graphs.key(64, 8), graphs.key(64, 64), graphs.key(64, 0)  # LoRA tiers 1 and 2
    tables = (dict(cfg.SPLITS_TABLE), dict(cfg.SHRINK_TABLE), dict(cfg.EXPAND_TABLE))

    def apply(overrides: dict) -> None:
        for table, saved in zip((cfg.SPLITS_TABLE, cfg.SHRINK_TABLE, cfg.EXPAND_TABLE), tables, strict=True):
            table.clear()
            table.update(saved)
        path = out / "candidate.json"
        path.write_text(json.dumps(overrides))
        cfg.load_overrides(str(path))

    logits_ref: dict[str, torch.Tensor] = {}

    def time_lora() -> tuple[float, float, float]:
        """(ms over 8 adapters, ms over 64, the 64-adapter logits' relative error against the
        committed table's, so a kernel variant that computes something else cannot win)."""
        graphs.recapture([key8, key64])
        result = []
        for slots, key in ((slots8, key8), (slots64, key64)):
            graphs.token_slots[:64].copy_(slots)
            result.append(gpu_ms(graphs.graphs[key]))
        logits = graphs.logits[:64].clone()
        ref = logits_ref.setdefault("ref", logits)
        err = ((logits - ref).norm() / ref.norm()).item()
        return result[0], result[1], err

    base = gpu_ms(graphs.graphs[base_key])
    rows: dict[str, dict] = {}

    def run(name: str, overrides: dict) -> None:
        apply(overrides)
        try:
            t8, t64, err = time_lora()
        except Exception as exc:  # a candidate that does not fit the buffers: report, go on
            rows[name] = dict(error=f"{type(exc).__name__}: {exc}")
            print(f"{name:<40} failed: {exc}", flush=True)
            return
        if err > 1e-2:
            rows[name] = dict(error=f"logits differ from the committed table's: relative error {err:.2e}")
            print(f"{name:<40} WRONG: logits relative error {err:.2e}", flush=True)
            return
        rows[name] = dict(overrides=overrides, ms_8=t8, ms_64=t64, ratio_8=base / t8, logits_rel_err=err)
        print(
            f"{name:<48} 8 adapters {t8:7.3f} ms ({base / t8:.3f} of base)  64 adapters {t64:7.3f} ms"
            f"  logits err {err:.1e}",
            flush=True,
        )

    print(f"base graph {base:.3f} ms", flush=True)
    cands = candidates()
    for name, overrides in cands.items():
        run(name, overrides)
    cur = rows["current table"]

    def better(r: dict) -> bool:  # faster over both mixes together, and neither mix slower by > 0.5%
        return (
            "ms_8" in r
            and r["ms_8"] + r["ms_64"] < cur["ms_8"] + cur["ms_64"]
            and r["ms_8"] <= cur["ms_8"] * 1.005
            and r["ms_64"] <= cur["ms_64"] * 1.005
        )

    def total(n: str) -> float:
        return rows[n]["ms_8"] + rows[n]["ms_64"]

    kinds = ("expand", "splits", "shrink")
    best = {
        k: min((n for n in rows if n.startswith(k) and better(rows[n])), key=total, default=None)
        for k in kinds
    }
    picked = [b for b in best.values() if b]
    if len(picked) > 1:
        run(" + ".join(picked), merge(*(cands[b] for b in picked)))
    winner = min(
        (n for n in rows if "ms_8" in rows[n] and (n == "current table" or better(rows[n]))), key=total
    )
    apply(rows[winner]["overrides"])  # the tight-grid and cuBLASLt checks run on the winner
    prepare = backend.prepare
    backend.prepare = lambda token_slots, max_distinct=None: prepare(token_slots, 8)
    graphs.recapture([key8])
    graphs.token_slots[:64].copy_(slots8)
    tight8 = gpu_ms(graphs.graphs[key8])
    backend.prepare = prepare
    print(
        f"{'grids sized for 8 adapters':<40} 8 adapters {tight8:7.3f} ms ({base / tight8:.3f} of base)",
        flush=True,
    )
    lib = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    graphs.recapture([base_key])
    base_lt = gpu_ms(graphs.graphs[base_key])
    lt8, lt64, _ = time_lora()
    torch.backends.cuda.preferred_blas_library(lib)
    print(
        f"{'cuBLASLt (base graph too)':<40} 8 adapters {lt8:7.3f} ms ({base_lt / lt8:.3f} of its base "
        f"{base_lt:.3f})  64 adapters {lt64:7.3f} ms",
        flush=True,
    )
    res = dict(
        device=torch.cuda.get_device_name(),
        base_ms=base,
        rows=rows,
        winner=winner,
        tight_grid_8_ms=tight8,
        cublaslt=dict(base_ms=base_lt, ms_8=lt8, ms_64=lt64),
    )
    write_json(out, "decode_sweep", res)
    write_json(out, "lora_configs", rows[winner]["overrides"])
    print(f"winner: {winner}: {json.dumps(rows[winner]['overrides'])}")
    asyncio.run(async_engine.shutdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
