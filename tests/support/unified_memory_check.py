"""The Triton LoRA backend over the adapter pool's pages inside the KV cache (--lora-memory unified)
gives the separate pool's tokens, bit for bit (the pages sit elsewhere; the arithmetic is the same).

Child of tests/integration/test_lora_unified_memory.py under TRITON_INTERPRET=1 (CPU, float32); on a
GPU the lead runs it as is (bf16, CUDA graphs on):

    PYTHONPATH=protos python tests/support/unified_memory_check.py [--device cuda] BASE NAME=DIR ...

Prints one line per check and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.engine.unified_blocks import UnifiedBlocks
from tests.support.lora_reference import PROMPTS, server_args, sync_engine


def run(
    base: str, adapters: dict[str, str], device: str, memory: str, batch: list[str | None]
) -> list[list[int]]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = sync_engine(
        server_args(
            base,
            adapters,
            device=device,
            dtype=dtype,
            lora_backend="triton",
            max_loras_per_batch=None,
            max_gpu_loras=len(adapters),
            lora_memory=memory,
        )
    )
    assert isinstance(engine.block_manager, UnifiedBlocks) == (memory == "unified")
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(batch)]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8), batch)
    return [o.token_ids for o in outs]


def main() -> int:
    torch.set_num_threads(1)
    args = sys.argv[1:]
    device = "cpu"
    if args[:1] == ["--device"]:
        device, args = args[1], args[2:]
    base, *pairs = args
    adapters = dict(p.split("=", 1) for p in pairs)
    batch = [None, *adapters, *adapters][: len(PROMPTS)]
    separate = run(base, adapters, device, "separate", batch)
    unified = run(base, adapters, device, "unified", batch)
    failures = 0
    for i, (a, b) in enumerate(zip(separate, unified, strict=True)):
        same = a == b
        failures += not same
        print(
            f"{'ok' if same else 'MISMATCH'} prompt {i} adapter {batch[i]}: separate {a} unified {b}",
            flush=True,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
