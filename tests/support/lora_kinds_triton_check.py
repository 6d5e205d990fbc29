"""Child of tests/integration/test_lora_kinds.py (TRITON_INTERPRET=1): the Triton LoRA backend (its
side-stream delta handover included) serves the same mixed batch as the torch backend, whose
tokens the parent checks against PEFT. argv: base model dir, then NAME=DIR adapters, then the
batch as comma-separated names ('-' for the base model). Prints one JSON line per sequence."""

from __future__ import annotations

import json
import sys

import torch

from tests.support.lora_kinds import engine_run
from tests.support.lora_reference import PROMPTS, server_args, sync_engine


def main() -> int:
    torch.set_num_threads(1)
    base, *pairs, batch_arg = sys.argv[1:]
    adapters = dict(p.split("=", 1) for p in pairs)
    batch = [None if n == "-" else n for n in batch_arg.split(",")]
    engine = sync_engine(
        server_args(base, adapters, max_loras_per_batch=len(adapters), lora_backend="triton")
    )
    assert type(engine.runner.lora_backend).__name__ == "TritonLoRABackend"
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(batch)]]
    for tokens, logprobs in engine_run(engine, prompts, batch):
        print(json.dumps({"tokens": tokens, "logprobs": logprobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
