"""The batch-64 rows of bench/serving.py again with one feature switched, in the same process.

Each variant switches one thing, recaptures the decode graphs it touches, checks that greedy
outputs do not change, times the rows and switches back: overlap scheduling off; the LoRA side
stream the other way; the LoRA graph tiers off (steps with <= 8 adapters replay the all-slots
graph); the side stream at high CUDA priority; an SM carve-out for cuBLAS inside LoRA graphs
(the base matmuls leave SMs free for the LoRA kernels beside them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

log = logging.getLogger("bench.serving")
CARVEOUT_SMS = 16


def matmul_carveout_probe() -> dict[str, float]:
    """ms of a decode-shaped matmul (64 x 4096 @ 4096 x 14336) through cuBLAS and cuBLASLt, with no
    carve-out and with half the SMs carved out: equal times mean that path ignores the carve-out."""
    import triton

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    out = {}
    lib = torch.backends.cuda.preferred_blas_library()
    for name in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(name)
        for carve in (None, torch.cuda.get_device_properties(0).multi_processor_count // 2):
            torch._C._set_sm_carveout_experimental(carve)
            out[f"{name}_carveout_{carve}"] = triton.testing.do_bench(lambda: x @ w.t(), warmup=20, rep=100,
                                                                      return_mode="median")
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library(lib)
    return out


def _carveout(sms: int | None, lib: str) -> None:
    torch._C._set_sm_carveout_experimental(sms)
    torch.backends.cuda.preferred_blas_library(lib)


def run_variants(engine, run: Callable, mixed: list[tuple[int, int]], check_prompts, check_adapters,
                 names: list[str], res: dict) -> None:
    from services.inference.engine.types import SamplingParams

    def greedy() -> list[list[int]]:
        done = engine.generate(check_prompts, SamplingParams(max_new_tokens=8, ignore_eos=True),
                               [None if a is None else names[a] for a in check_adapters])
        return [c.token_ids for c in done]

    equal = res.setdefault("greedy_variants_equal", {})
    on = engine.config
    if on.overlap_enabled:
        engine.step()  # resolve the in-flight step before switching overlap off
        engine.config = dataclasses.replace(on, overlap_schedule=False)
        res["greedy_no_overlap_equal"] = greedy() == res["greedy_engine"]
        for batch, distinct in [(64, 0), *(m for m in mixed if m == (64, 8))]:
            run(batch, distinct, "no overlap")
        engine.config = on
    backend = engine.runner.lora_backend
    graphs = getattr(engine.runner, "cuda_graphs", None)
    if not hasattr(backend, "set_side_stream"):
        return
    keys = sorted({(graphs.bucket(b), t) for b in [*(b for b, _ in mixed), 4] for t in graphs.lora_tiers}) if graphs else []

    def variant(label: str, switch: Callable[[], None], restore: Callable[[], None], rows) -> None:
        switch()
        if graphs is not None:
            graphs.recapture(keys)
        try:
            equal[label] = greedy() == res["greedy_engine"]
            for batch, distinct in rows:
                run(batch, distinct, label)
        finally:
            restore()
            if graphs is not None:
                graphs.recapture(keys)

    side, prio = backend.side_stream, backend.side_priority
    variant("LoRA side stream" if not side else "LoRA serial",
            lambda: backend.set_side_stream(not side), lambda: backend.set_side_stream(side, prio), mixed)
    if graphs is None:
        return
    if len(graphs.lora_tiers) > 1:
        tiers = graphs.lora_tiers
        few = [m for m in mixed if m[1] <= tiers[0]]
        graphs.lora_tiers = tiers[-1:]  # the all-slots graphs exist already: nothing to recapture
        try:
            equal["LoRA tiers off"] = greedy() == res["greedy_engine"]
            for batch, distinct in few:
                run(batch, distinct, "LoRA tiers off")
        finally:
            graphs.lora_tiers = tiers
    if side:
        other = 0 if prio < 0 else -1
        variant(f"side stream priority {other}", lambda: backend.set_side_stream(True, other),
                lambda: backend.set_side_stream(True, prio), mixed)
    res["matmul_carveout_probe_ms"] = matmul_carveout_probe()
    log.info("matmul carve-out probe %s", res["matmul_carveout_probe_ms"])
    lib = str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower()
    for name in ("cublas", "cublaslt"):
        variant(f"{name} carve-out {CARVEOUT_SMS} SMs", lambda name=name: _carveout(CARVEOUT_SMS, name),
                lambda: _carveout(None, lib), mixed)
