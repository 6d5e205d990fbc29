"""CUDA-graph timing shared by the GPU benchmarks: capture once, time replays with events."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(work: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run `work` once on a side stream (lazy init, autotune), capture it, replay it once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
    """Milliseconds of each of `reps` replays, each timed alone with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def graph_time_us(fns: list, replays: int = 20) -> float:
    """Median time per call of replaying one CUDA graph that runs every callable once."""
    graph = capture(lambda: [f() for f in fns])
    times = [t * 1e3 / len(fns) for t in replay_ms(graph, replays)]
    del graph
    return sorted(times)[len(times) // 2]
