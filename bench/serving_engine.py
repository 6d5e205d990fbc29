"""Engine measurements for bench/serving.py: decode steps at a batch over fixed contexts, prefill.

The engine is built with the server's own `build_engine(config, lora_config)` (loader, LoRA pool and manager,
KV cache, CUDA graphs); its engine thread is stopped and `LLMEngine.step()` is driven from here
so each step can be timed. A step's wall time is split, through the engine's step timer, into the
model runner's forward (input preparation + GPU, synchronized) and the rest (scheduling, sampling,
stop checks, detokenization).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import NamedTuple

import torch

from loraplex.bench.graph_timing import replay_ms
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.types import SamplingParams

_ids = itertools.count()


class StepTiming(NamedTuple):
    batch: int
    steps: int
    mean_context: float  # tokens per sequence at the middle of the timed steps
    ms_per_step: float
    tokens_per_s: float
    forward_ms: float  # model runner forward: input prep + GPU (synchronized)
    other_ms: float  # schedule + sample + stop checks + detokenize
    schedule_ms: float
    sample_ms: float
    output_ms: float  # stop checks + incremental detokenization of every request's token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ForwardClock:
    """Times the phases of a step through `LLMEngine.step_timer`: the runner's forward (synced; the
    step syncs right after it anyway, to sample), scheduling, sampling, and the output phase (stop
    checks + detokenize)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.device = engine.runner.device
        self.total = 0.0
        self.parts: dict[str, float] = {"schedule": 0.0, "sample": 0.0, "output": 0.0}
        engine.step_timer = self._phase_done

    def _phase_done(self, phase: str, started: float, result: object) -> None:
        if phase == "forward":
            if not self._overlaps():
                _sync(self.device)
            self.total += time.perf_counter() - started
        else:
            self.parts[phase] += time.perf_counter() - started

    def _overlaps(self) -> bool:
        # With overlap scheduling a sync would wait for the step the host should run beside: then
        # forward_ms is launch time only and the step's GPU time comes from graph_replay_ms. The engine
        # overlaps only with the plain runner (not tensor parallelism's step broadcast); a variant may
        # switch it off mid-run (serving_variants), so this is read per step.
        return self.engine.config.overlap_enabled and isinstance(self.engine.runner, ModelRunner)

    def reset(self) -> None:
        self.total = 0.0
        self.parts = dict.fromkeys(self.parts, 0.0)


def add_batch(engine, prompts: list[list[int]], adapters: list[str | None], max_new_tokens: int) -> list[str]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for prompt, adapter in zip(prompts, adapters, strict=True):
        rid = f"bench-{next(_ids)}"
        engine.add_request(rid, prompt, params, adapter)
        ids.append(rid)
    return ids


def run_until_decoding(engine, ids: list[str], timeout_s: float = 600.0) -> None:
    """Step until every request has produced its first token (all prompts prefilled)."""
    pending = set(ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} requests still prefilling after {timeout_s} s")
        for out in engine.step():
            if out.finished and out.request_id in pending and out.finish_reason == "abort":
                raise RuntimeError(f"request {out.request_id} aborted: {engine.errors.get(out.request_id)}")
            pending.discard(out.request_id)


def abort_all(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)


def measure_decode(
    engine,
    clock: ForwardClock,
    prompts: list[list[int]],
    adapters: list[str | None],
    steps: int,
    warmup: int = 3,
) -> StepTiming:
    """Decode steps with every request of the batch running (contexts = prompt length + a few)."""
    # Generous max_new_tokens: the first requests decode while the last ones still prefill, and
    # none may finish before the timed steps (all are aborted at the end).
    ids = add_batch(engine, prompts, adapters, max_new_tokens=1024)
    run_until_decoding(engine, ids)
    running = len(engine.scheduler.running)
    if running != len(ids):
        raise RuntimeError(
            f"only {running} of {len(ids)} requests are running (KV cache or slots too small?)"
        )
    for _ in range(warmup):
        engine.step()
    _sync(clock.device)
    running_reqs = engine.scheduler.running
    mean_context = sum(len(r.token_ids) for r in running_reqs) / len(running_reqs) + steps / 2
    times, forward, parts = [], [], []
    for _ in range(steps):
        clock.reset()
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        forward.append(clock.total)
        parts.append(dict(clock.parts))
        if len(outs) != len(ids):
            raise RuntimeError(f"a decode step returned {len(outs)} outputs for {len(ids)} requests")
    abort_all(engine, ids)
    ms = 1e3 * statistics.median(times)
    fwd = 1e3 * statistics.median(forward)
    part_ms = {k: 1e3 * statistics.median(p[k] for p in parts) for k in ("schedule", "sample", "output")}
    return StepTiming(
        len(ids),
        steps,
        mean_context,
        ms,
        len(ids) / (ms / 1e3),
        fwd,
        ms - fwd,
        part_ms["schedule"],
        part_ms["sample"],
        part_ms["output"],
    )


def measure_prefill(engine, prompts: list[list[int]], adapters: list[str | None], repeats: int = 2) -> dict:
    """Wall time from adding the prompts to every first token (max_new_tokens=1); best of `repeats`."""
    best = float("inf")
    for i in range(repeats + 1):  # the first run warms up (kernel compiles, adapter uploads)
        _sync(engine.runner.device)
        start = time.perf_counter()
        ids = add_batch(engine, prompts, adapters, max_new_tokens=1)
        run_until_decoding(engine, ids)
        _sync(engine.runner.device)
        elapsed = time.perf_counter() - start
        if i > 0:
            best = min(best, elapsed)
    tokens = sum(len(p) for p in prompts)
    return dict(prompts=len(prompts), tokens=tokens, seconds=best, tokens_per_s=tokens / best)


def graph_replay_ms(engine, batch: int, distinct: int, reps: int = 20) -> float | None:
    """GPU time of one captured decode step (the static inputs of the last step still bound)."""
    graphs = getattr(engine.runner, "cuda_graphs", None)
    key = None if graphs is None else graphs.key(batch, distinct)
    if key is None or key not in graphs.graphs:
        return None
    return statistics.median(replay_ms(graphs.graphs[key], reps))
