"""Child process of tests/integration/test_model_families.py (TRITON_INTERPRET=1): every family's
tiny random model through the CUDA path's kernels on the CPU (fused norms with the unit offset,
q/k norms inside the rotary launch, GeGLU, windowed and soft-capped paged attention, the Triton
LoRA backend, the mixed-step pieces) against the same model on the torch path, step by step over
chunked prefill at offsets and decodes, with contexts past the sliding window. Prints one line per
family and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from loraplex.bench.random_runner import TINY, TINY_FAMILIES, build_runner
from loraplex.kernels.placement import run_triton_on_cpu
from loraplex.services.inference.engine.scheduled_batch import SeqChunk

A_BLOCKS, B_BLOCKS = list(range(1, 7)), list(range(7, 13))
STEPS = [
    [
        SeqChunk(list(range(3, 15)), 0, A_BLOCKS, 0, False),
        SeqChunk(list(range(20, 26)), 0, B_BLOCKS, 1, True),
    ],
    [SeqChunk([30], 6, B_BLOCKS, 1, True), SeqChunk(list(range(40, 48)), 12, A_BLOCKS, 0, True)],
    [SeqChunk([50], 20, A_BLOCKS, 0, True), SeqChunk([51], 7, B_BLOCKS, -1, True)],
]


def logits(family: str, triton: bool) -> list[torch.Tensor]:
    run_triton_on_cpu(triton)
    try:
        runner = build_runner(
            {**TINY, **TINY_FAMILIES[family]},
            dtype=torch.float32,
            device=torch.device("cpu"),
            slots=2,
            rank=8,
            max_num_tokens=32,
            max_num_seqs=4,
            context_length=64,
            page_size=4,
            num_blocks=16,
            lora_backend="triton" if triton else "torch",
        )
        if triton:
            runner.capture_mixed_graphs(32, use_graphs=False)
        return [runner.forward(step).clone() for step in STEPS]
    finally:
        run_triton_on_cpu(False)


def main() -> int:
    failures = 0
    for family in TINY_FAMILIES:
        want, got = logits(family, False), logits(family, True)
        err = max(float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))
        ok = err < 1e-4 and all(g.shape == w.shape for g, w in zip(got, want, strict=True))
        failures += not ok
        print(f"{family}: triton path vs torch path max rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
