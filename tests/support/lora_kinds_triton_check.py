"""Child of tests/integration/test_lora_kinds.py (TRITON_INTERPRET=1): the Triton LoRA backend (its
side-stream delta handover included) serves the same mixed batch as the torch backend, whose
tokens the parent checks against PEFT. argv: [--graphs] base model dir, then NAME=DIR adapters, then
the batch as comma-separated names ('-' for the base model). Prints one JSON line per sequence.
`--graphs`: decode steps take the decode CUDA graphs' path run eagerly (`use_graphs=False`), as on a
GPU, kinds variant included (captured lazily on the first step holding such adapters); a last line
`graphs: N steps, variants [...]` says what they served."""

from __future__ import annotations

import json
import sys

import torch

from tests.support.lora_kinds import engine_run
from tests.support.lora_reference import PROMPTS, server_args, sync_engine


def main() -> int:
    torch.set_num_threads(1)
    argv = sys.argv[1:]
    graphs = argv[0] == "--graphs"
    base, *pairs, batch_arg = argv[1:] if graphs else argv
    adapters = dict(p.split("=", 1) for p in pairs)
    batch = [None if n == "-" else n for n in batch_arg.split(",")]
    engine = sync_engine(
        server_args(base, adapters, max_loras_per_batch=len(adapters), lora_backend="triton")
    )
    assert type(engine.runner.lora_backend).__name__ == "TritonLoRABackend"
    served = {"graphs": 0}
    if graphs:
        from tests.support.decode_graphs_check import graphs_eagerly

        graphs_eagerly(engine.runner, 8, served, "graphs")
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(batch)]]
    for tokens, logprobs in engine_run(engine, prompts, batch):
        print(json.dumps({"tokens": tokens, "logprobs": logprobs}))
    if graphs:
        variants = sorted({key[2] for key in engine.runner.cuda_graphs.graphs})
        print(f"graphs: {served['graphs']} steps, variants {variants}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
