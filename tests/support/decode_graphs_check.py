"""Child process of tests/integration/test_decode_graphs_eager.py (TRITON_INTERPRET=1): the decode
CUDA graphs' path (engine/cuda_graph.py) run eagerly on the CPU (`use_graphs=False`) against the same
Triton runner without them, step by step: decodes over two adapters and the base model (padded to a
ladder size), a step that samples no row (a draft model's catch-up), verify chunks laid out as decode
rows, a base-only step (the tier without LoRA) and a step that samples some rows. A draft-model
catch-up crashed on an H100 in this glue (2026-12-08: a float index for no sampled row), which no
CPU test reached. Prints one line per step and exits non-zero on a mismatch.
"""

from __future__ import annotations

import random
import sys

import torch

from loraplex.bench.random_runner import TINY, build_runner
from loraplex.kernels.placement import run_triton_on_cpu
from loraplex.services.inference.engine.scheduled_batch import SeqChunk

PAGE = 4
TABLES = {"a": list(range(1, 9)), "b": list(range(9, 17)), "c": list(range(17, 25))}
SLOTS = {"a": 0, "b": 1, "c": -1}


def steps() -> list[tuple[str, list[SeqChunk]]]:
    """(name, chunks) per step, positions following on from the step before."""
    rnd = random.Random(5)
    pos = {"a": 0, "b": 0, "c": 0}

    def chunk(seq: str, n: int, sample: bool = True, verify: bool = False, slot: int | None = None):
        ids = [rnd.randrange(TINY["vocab_size"]) for _ in range(n)]
        c = SeqChunk(ids, pos[seq], TABLES[seq], SLOTS[seq] if slot is None else slot, sample, verify=verify)
        pos[seq] += n
        return c

    return [
        ("prefill (eager: segments)", [chunk("a", 6), chunk("b", 5), chunk("c", 3)]),
        ("decode, 2 adapters + base", [chunk("a", 1), chunk("b", 1), chunk("c", 1)]),
        ("decode, no row sampled", [chunk(s, 1, sample=False) for s in "abc"]),
        ("verify rows", [chunk("b", 1), chunk("a", 3, verify=True), chunk("c", 2, verify=True)]),
        ("decode, base only", [chunk("a", 1, slot=-1), chunk("b", 1, slot=-1), chunk("c", 1)]),
        ("decode, some rows sampled", [chunk("a", 1), chunk("b", 1, sample=False), chunk("c", 1)]),
    ]


def graphs_eagerly(runner, max_bs: int, served: dict[str, int], name: str) -> None:
    """Give `runner` decode graphs up to `max_bs` that run eagerly (`use_graphs=False`), counting in
    `served[name]` the steps they serve (their `run` returns logits rather than None)."""
    runner.capture_cuda_graphs(max_bs, use_graphs=False)
    inner = runner.cuda_graphs.run

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        served[name] += out is not None
        return out

    runner.cuda_graphs.run = counted


def run(graphs: bool) -> tuple[list[torch.Tensor], int]:
    """Each step's logits, and how many steps the decode graphs' path served."""
    run_triton_on_cpu(True)
    try:
        runner = build_runner(
            TINY,
            dtype=torch.float32,
            device=torch.device("cpu"),
            slots=2,
            rank=4,
            max_num_tokens=32,
            max_num_seqs=8,
            context_length=32,
            page_size=PAGE,
            num_blocks=32,
        )
        served = {"graphs": 0}
        if graphs:
            graphs_eagerly(runner, 8, served, "graphs")
        return [runner.forward(chunks).clone() for _, chunks in steps()], served["graphs"]
    finally:
        run_triton_on_cpu(False)


def main() -> int:
    torch.manual_seed(0)
    want, _ = run(False)
    got, served = run(True)
    failures = 0
    for (name, chunks), g, w in zip(steps(), got, want, strict=True):
        rows = sum(len(c.token_ids) if c.verify else int(c.sample) for c in chunks)
        err = float((g - w).abs().max() / w.abs().max()) if w.numel() else 0.0
        ok = g.shape == w.shape == (rows, TINY["vocab_size"]) and err < 1e-5
        failures += not ok
        print(f"{name}: {tuple(g.shape)} rows, max rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    ok = served == len(got) - 1  # every step but the prefill
    failures += not ok
    print(f"decode graphs served {served} of {len(got) - 1} steps {'ok' if ok else 'FAIL'}")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
