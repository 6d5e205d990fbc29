"""Child process of tests/unit/test_lora_fused.py (TRITON_INTERPRET=1).

1. The fused LoRA kernel against its torch reference and the two-kernel path on random cases
   (`loraplex.kernels.lora_fused_check`: mixed ranks, 1 to 256 adapters, rows without adapter,
   in-place and delta modes).
2. A tiny random Llama with three adapters, greedy over a mixed prefill then decodes, through the
   Triton LoRA backend with LORAPLEX_LORA_FUSED=on against off, with the side stream's delta mode
   and without: the same tokens, logits within 1e-5, and the fused kernel really ran.

Prints JSON lines for the kernel cases, then one `engine ...` line per mode; exits non-zero on a failure.
"""

from __future__ import annotations

import sys

import torch

import loraplex.services.inference.lora.triton_backend as triton_backend
from loraplex.bench.random_runner import TINY, build_runner
from loraplex.kernels import lora_fused_check
from loraplex.services.inference.engine.scheduler import SeqChunk

PAGES_PER_SEQ = 8  # page size 4: contexts up to 32
PROMPTS = [
    (list(range(3, 12)), 0),
    (list(range(20, 26)), 1),
    (list(range(40, 47)), -1),
    (list(range(60, 64)), 2),
    (list(range(70, 81)), 0),
]
NEW_TOKENS = 5

FUSED_CALLS = [0]
_real_fused = triton_backend.lora_fused


def _counting_fused(*args, **kwargs):
    FUSED_CALLS[0] += 1
    return _real_fused(*args, **kwargs)


def greedy(
    fused: str, side_stream: bool, handoff: bool = False
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's greedy continuation and every step's logits (`handoff`: LORAPLEX_LORA_HANDOFF)."""
    runner = build_runner(
        TINY,
        dtype=torch.float32,
        device=torch.device("cpu"),
        slots=3,
        rank=8,
        max_num_tokens=64,
        max_num_seqs=8,
        context_length=32,
        page_size=4,
        num_blocks=len(PROMPTS) * PAGES_PER_SEQ + 1,
        side_stream=side_stream,
    )
    runner.lora_backend.fused_mode = fused
    runner.lora_backend.handoff = handoff
    runner.capture_mixed_graphs(64, use_graphs=False)
    tables = [list(range(1 + i * PAGES_PER_SEQ, 1 + (i + 1) * PAGES_PER_SEQ)) for i in range(len(PROMPTS))]
    seqs = [list(ids) for ids, _ in PROMPTS]
    chunks = [SeqChunk(ids, 0, tables[i], slot, True) for i, (ids, slot) in enumerate(PROMPTS)]
    all_logits = []
    for _ in range(NEW_TOKENS):
        logits = runner.forward(chunks)
        all_logits.append(logits.clone())
        for s, tok in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            s.append(tok)
        chunks = [SeqChunk([s[-1]], len(s) - 1, tables[i], PROMPTS[i][1], True) for i, s in enumerate(seqs)]
    return [s[len(p[0]) :] for s, p in zip(seqs, PROMPTS, strict=True)], all_logits


def engine_check() -> int:
    triton_backend.lora_fused = _counting_fused
    failures = 0
    try:
        for side in (False, True):
            FUSED_CALLS[0] = 0
            want, want_logits = greedy("off", side)
            calls_off = FUSED_CALLS[0]
            got, got_logits = greedy("on", side)
            calls_on = FUSED_CALLS[0] - calls_off
            err = max(float((g - w).norm() / w.norm()) for g, w in zip(got_logits, want_logits, strict=True))
            ok = got == want and err < 1e-5 and calls_off == 0 and calls_on > 0
            failures += not ok
            print(
                f"engine side_stream={side}: tokens equal {got == want}, logits rel err {err:.2e},"
                f" fused launches {calls_on} (off: {calls_off}) {'ok' if ok else 'FAIL'}",
                flush=True,
            )
    finally:
        triton_backend.lora_fused = _real_fused
    return failures


def main() -> int:
    failures = lora_fused_check.main()
    failures += engine_check()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
