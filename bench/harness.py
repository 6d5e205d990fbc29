"""The benchmarks' shared harness: the device and the model shape (Llama-3.1-8B with random weights on the
GPU, the tiny shape on the CPU), the memory and compute ceilings measured in the same run, a decode
or prefill step of a random-weight ModelRunner timed with CUDA events around the step (its CUDA graph
replay inside), its memory floor, progress lines with timestamps, and markdown tables.

Every suite (bench/step.py, bench/kernels.py, bench/workload.py, ...) and bench/goals.py build on it,
so a figure means the same thing wherever it is printed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time

import torch

from loraplex.bench.random_runner import TINY, build_runner
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.services.inference.engine.scheduled_batch import SeqChunk

PAGE = 16
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line: wall-clock time and seconds since the process started, so a cut-off run's
    output still says how far it got and how long each part took."""
    now = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - _T0:5.0f}s] {msg}", flush=True)


def suite_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """--tiny and --device, the flags every model-building suite takes (--out: bench/results.py)."""
    p = argparse.ArgumentParser(prog=f"python -m loraplex.bench.{prog}", description=description)
    p.add_argument("--tiny", action="store_true", help="the tiny model shape (the CPU smoke size)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    return p


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def model_shape(tiny: bool) -> dict:
    return TINY if tiny else LLAMA_8B


def float_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU (what is served); float32 on the CPU (bf16 matmuls there are slow and odd)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def meta(device: torch.device, tiny: bool) -> dict:
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        size="tiny" if tiny else "full",
        machine=f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        torch=torch.__version__,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes read + written per second by a 2 GiB device-to-device copy (CUDA only: None elsewhere)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 20 * 2 * src.nbytes / (start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def matmul_rate(device: torch.device) -> float | None:
    """bf16 matmul FLOP/s of an 8192-cube product (CUDA only)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    end.synchronize()
    return 20 * 2 * 8192**3 / (start.elapsed_time(end) * 1e-3)


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the model: every parameter and buffer as stored (FP8 weights and
    their scales included), less the embedding table unless the lm_head is tied to it (a step only
    gathers the batch's rows of it)."""
    total = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.nbytes
    return total


def kv_bytes(runner, batch: int, context: int) -> int:
    """The K/V a decode step reads: every sequence's `context` tokens in every layer (a sliding-window
    layer at most its window), at the cache's element size."""
    cfg = runner.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv_cache.element_size()
    windows = runner.attention.windows or [None] * cfg.num_layers
    return sum(batch * min(context, w or context) * per_token for w in windows)


def adapter_bytes(runner, distinct: int) -> int:
    """The A/B bytes of `distinct` pool slots (at the pool's max rank: an upper bound)."""
    backend = runner.lora_backend
    if backend is None or not distinct:
        return 0
    return backend.pool.nbytes * distinct // backend.pool.slots


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_runner(
    shape: dict,
    device: torch.device,
    *,
    batch: int,
    context: int,
    adapters: int = 0,
    rank: int = 16,
    fp8: bool = False,
    kv_dtype: torch.dtype | None = None,
    max_tokens: int = 0,
    graphs: bool = True,
):
    """A random-weight runner of `shape` with room for `batch` sequences of `context` tokens, `adapters`
    random adapters resident and, on CUDA, the decode graphs captured as the engine captures them."""
    pages = -(-(context + 1) // PAGE)
    runner = build_runner(
        shape,
        dtype=float_dtype(device),
        device=device,
        slots=adapters,
        rank=rank,
        max_num_tokens=max(batch, max_tokens),
        max_num_seqs=batch,
        context_length=pages * PAGE,
        page_size=PAGE,
        num_blocks=batch * pages + 1,
        lora_backend="triton" if device.type == "cuda" else "torch",
        fp8=fp8,
        kv_dtype=kv_dtype,
    )
    runner.kv_cache.zero_()
    if device.type == "cuda" and graphs:
        runner.capture_cuda_graphs(batch)
    return runner, pages


def decode_chunks(batch: int, context: int, pages: int, adapters: int, distinct_tokens: bool = False):
    """One decode step: sequence b at position `context - 1` on adapter b % adapters (none when 0);
    `distinct_tokens`: each sequence feeds its own token (a mixture of experts routes them apart)."""
    return [
        SeqChunk(
            [7 + b if distinct_tokens else 7],
            context - 1,
            list(range(1 + b * pages, 1 + (b + 1) * pages)),
            b % adapters if adapters else -1,
            True,
        )
        for b in range(batch)
    ]


def prefill_chunks(tokens: int, pages: int, adapters: int, segments: int = 8) -> list[SeqChunk]:
    """`segments` fresh prompts of tokens / segments each, on adapters round-robin (none when 0)."""
    per = tokens // segments
    return [
        SeqChunk(
            [(3 * j + s) % 100 + 1 for j in range(per)],
            0,
            list(range(1 + s * pages, 1 + (s + 1) * pages)),
            s % adapters if adapters else -1,
            True,
        )
        for s in range(segments)
    ]


def time_step(runner, chunks: list[SeqChunk], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of one step through `runner.forward` (inputs uploaded, graph replayed,
    logits out): CUDA events around each step on the GPU, wall time on the CPU."""
    cuda = runner.device.type == "cuda"
    for _ in range(warmup):
        runner.forward(chunks)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.forward(chunks)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            runner.forward(chunks)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_step(
    shape: dict,
    device: torch.device,
    *,
    batch: int,
    context: int,
    repeats: int,
    bandwidth: float | None,
    adapters: int = 0,
    fp8: bool = False,
    kv_dtype: torch.dtype | None = None,
    name: str = "",
) -> dict:
    """One decode step of a freshly built runner against its memory floor: the weights as stored,
    the batch's K/V and the distinct adapters' A/B, over the copy bandwidth (None on the CPU)."""
    runner, pages = step_runner(
        shape, device, batch=batch, context=context, adapters=adapters, fp8=fp8, kv_dtype=kv_dtype
    )
    ms = time_step(runner, decode_chunks(batch, context, pages, adapters), repeats)
    weights, kv = weight_bytes(runner.model), kv_bytes(runner, batch, context)
    read = weights + kv + adapter_bytes(runner, adapters)
    del runner
    free(device)
    floor = read / bandwidth * 1e3 if bandwidth else None
    return dict(
        case=name,
        batch=batch,
        context=context,
        adapters=adapters,
        ms=ms,
        weight_gb=weights / 1e9,
        kv_gb=kv / 1e9,
        read_gb=read / 1e9,
        floor_ms=floor,
        x_floor=ms / floor if floor else None,
    )


def fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def print_table(headers: list[str], rows: list[list]) -> None:
    """A markdown table (numbers right-aligned), what docs/benchmarks.md pastes."""
    print("| " + " | ".join(headers) + " |")
    print("| --- |" + " ---: |" * (len(headers) - 1))
    for row in rows:
        print("| " + " | ".join(fmt(c) for c in row) + " |")
