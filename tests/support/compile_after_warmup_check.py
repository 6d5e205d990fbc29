"""Child process of tests/integration/test_compile_after_warmup.py (TRITON_INTERPRET=1, the CUDA
path's kernels on CPU).

Warms a tiny engine runner up exactly as the engine does at start-up, then serves varied steps
(decode counts, chunked prefill at offsets, adapter mixes across every tier, token counts across
the whole range) and prints, as JSON, the Triton specialisation keys those steps launched that the
warm-up did not (each would be a compile while serving). A control step larger than the warm-up's
token limit must show new keys, so the check can see a new shape class when there is one.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from loraplex.bench.random_runner import TINY, build_runner
from loraplex.kernels.compile_watch import record_launch_keys
from loraplex.kernels.placement import run_triton_on_cpu
from loraplex.services.inference.engine.scheduled_batch import SeqChunk
from loraplex.services.inference.engine.warmup import warm_up

MAX_TOKENS, MAX_SEQS, SLOTS, PAGE = 48, 20, 18, 16
# One layer: every layer launches the same kernels with the same specialisation keys, so more layers
# only repeat the interpreter's work (2 layers took ~3x as long) without adding a key to compare.
SHAPE = {**TINY, "num_hidden_layers": 1}


def varied_steps(seed: int, max_tokens: int) -> list[list[SeqChunk]]:
    rnd = random.Random(seed)
    steps = []
    for _ in range(10):
        nd = rnd.randint(0, MAX_SEQS)
        distinct = rnd.choice([0, 1, 3, SLOTS])

        def slot(k: int = distinct) -> int:
            return rnd.randrange(k) if k else -1

        chunks = [
            SeqChunk([rnd.randrange(100)], p, list(range(1, 2 + p // PAGE)), slot(), True)
            for p in (rnd.randrange(60) for _ in range(nd))
        ]
        room = max_tokens - nd
        while room >= 2 and rnd.random() < 0.7:
            n = rnd.randint(2, room)
            start = rnd.choice([0, 5, 16, 33])
            chunks.append(
                SeqChunk(
                    [rnd.randrange(100) for _ in range(n)],
                    start,
                    list(range(1, 2 + (start + n) // PAGE)),
                    slot(),
                    rnd.random() < 0.5,
                )
            )
            room -= n
        if chunks:
            steps.append(chunks)
    return steps


def main() -> int:
    run_triton_on_cpu(True)
    runner = build_runner(
        SHAPE,
        dtype=torch.float32,
        device=torch.device("cpu"),
        slots=SLOTS,
        rank=8,
        max_num_tokens=2 * MAX_TOKENS,
        max_num_seqs=MAX_SEQS,
        context_length=256,
        page_size=PAGE,
        num_blocks=64,
        side_stream=True,
    )
    with record_launch_keys() as warm:
        warm_up(runner, max_num_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, context_length=256)
    with record_launch_keys() as served:
        for chunks in varied_steps(0, MAX_TOKENS):
            runner.forward(chunks)
    with (
        record_launch_keys() as control
    ):  # 80 tokens: a segment tile (128) the warm-up (<= 48 tokens) never ran
        runner.forward([SeqChunk(list(range(80)), 0, [1, 2, 3, 4, 5, 6], 0, True)])
    print(
        json.dumps(
            {
                "warmup_keys": len(warm.keys),
                "served_keys": len(served.keys),
                "new_after_warmup": sorted(name for name, _ in served.new_since(warm.keys)),
                "control_new": sorted(name for name, _ in control.new_since(warm.keys | served.keys)),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
