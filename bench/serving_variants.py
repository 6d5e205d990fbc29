"""The batch-64 rows of bench/serving.py again with one feature switched, in the same process:
overlap scheduling off, and the LoRA side stream the other way. Each variant checks that greedy
outputs do not change.

Variants measured on the H200 and dropped (a high-priority side stream, an SM carve-out for the
base matmuls, LoRA issued after the base matmul) are listed in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


def run_variants(
    engine,
    run: Callable,
    mixed: list[tuple[int, int]],
    check_prompts,
    check_adapters,
    names: list[str],
    res: dict,
) -> None:
    from loraplex.services.inference.engine.types import SamplingParams

    def greedy() -> list[list[int]]:
        # Compare like with like: the first check ran on an empty prefix cache. A cached prefix
        # runs the rest of the prompt as a shorter prefill, whose bf16 sums differ in the last
        # bits, which flips the random model's near-tied greedy tokens (measured on the H100).
        engine.block_manager.reset_prefix_cache(engine.block_manager.prefix_cache)
        done = engine.generate(
            check_prompts,
            SamplingParams(max_new_tokens=8, ignore_eos=True),
            [None if a is None else names[a] for a in check_adapters],
        )
        return [c.token_ids for c in done]

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
    keys = sorted({graphs.key(b, d) for b, d in [*mixed, (4, 1)]}) if graphs else []
    side = backend.side_stream
    label = "LoRA side stream" if not side else "LoRA serial"
    backend.set_side_stream(not side)
    try:
        if graphs is not None:
            graphs.recapture(keys)
        res["greedy_variants_equal"] = {label: greedy() == res["greedy_engine"]}
        for batch, distinct in mixed:
            run(batch, distinct, label)
    finally:
        backend.set_side_stream(side)
        if graphs is not None:
            graphs.recapture(keys)
