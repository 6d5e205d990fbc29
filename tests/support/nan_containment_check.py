"""One request's non-finite values stay in its own rows (issue 59, H3), on the torch path and, run as a
child under TRITON_INTERPRET=1, on the CUDA path's kernels (Triton attention, fused ops, the Triton LoRA
backend).

The load-time checks are bypassed on purpose: slot 0 of the pool is filled with NaN (an adapter that
got in), and every other slot's padding past its rank too (what an unloaded adapter leaves behind; the
pool never clears it). Then, against a clean reference run of a base request and one of adapter slot 1:
1. the three requests decode side by side: base and slot 1 give the reference logits, slot 0's rows are
   NaN (the poison reached the forward, so the check means something);
2. the base request decodes again on the KV pages the NaN request left (stale rows past its context,
   as a freed block is handed to the next request): again the reference logits.

`python tests/support/nan_containment_check.py [torch|triton]` prints one line per model and exits
non-zero on a failure.
"""

from __future__ import annotations

import sys

import torch

from loraplex.bench.random_runner import TINY, TINY_FAMILIES, build_runner
from loraplex.kernels.placement import run_triton_on_cpu
from loraplex.services.inference.engine.scheduled_batch import SeqChunk
from loraplex.services.inference.lora.backend import GROUPS

PAGE = 4
BASE, GOOD, BAD = list(range(3, 12)), list(range(20, 27)), list(range(40, 53))  # 9, 7, 13 tokens
TABLES = [list(range(1, 6)), list(range(6, 11)), list(range(11, 16))]  # 5 pages of 4: contexts to 20
NEW = 4
SHAPES = {"llama": TINY, "mixtral": {**TINY, **TINY_FAMILIES["mixtral"]}}


def poison(pool) -> None:
    """NaN in all of slot 0's pages, in every free page, and in every other slot's rows past its rank
    (what an evicted adapter leaves behind; the pool never clears it)."""
    P = pool.page_rows
    owned = {p for s in range(1, pool.slots) for p in pool.host_pages[s]}
    stale = [p for p in range(pool.num_pages) if p not in owned]
    for g in pool.groups:
        pool.lora_a[g][:, stale] = float("nan")
        pool.lora_b[g][:, stale] = float("nan")
        for layer in range(pool.shapes.num_layers):
            for slot in range(1, pool.slots):
                pages = pool.host_pages[slot]
                for i in range(len(GROUPS[g])):
                    r = int(pool.host_rank[g][layer, slot, i])
                    lo, hi = pool.offsets[g][i], pool.offsets[g][i + 1]
                    for j in range(r, len(pages) * P):
                        pool.lora_a[g][layer, pages[j // P], i * P + j % P] = float("nan")
                        pool.lora_b[g][layer, pages[j // P], j % P, lo:hi] = float("nan")


def greedy(runner, requests: list[tuple[list[int], int, list[int]]]) -> list[list[torch.Tensor]]:
    """Each (prompt, slot, block table)'s logits per step: one prefill step, then NEW - 1 decodes."""
    seqs = [list(p) for p, _, _ in requests]
    chunks = [SeqChunk(list(p), 0, t, s, True) for p, s, t in requests]
    out: list[list[torch.Tensor]] = [[] for _ in requests]
    for _ in range(NEW):
        logits = runner.forward(chunks)
        for i, row in enumerate(logits):
            out[i].append(row.clone())
            seqs[i].append(int(row.argmax()))
        chunks = [
            SeqChunk([s[-1]], len(s) - 1, t, slot, True)
            for s, (_, slot, t) in zip(seqs, requests, strict=True)
        ]
    return out


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error over the steps (inf where `got` is not finite)."""
    if not all(bool(torch.isfinite(g).all()) for g in got):
        return float("inf")
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


def check(model: str, triton: bool) -> list[str]:
    """The failures of one model on one path (empty: contained)."""
    run_triton_on_cpu(triton)
    try:
        runner = build_runner(
            SHAPES[model],
            dtype=torch.float32,
            device=torch.device("cpu"),
            slots=3,
            rank=8,
            max_num_tokens=64,
            max_num_seqs=4,
            context_length=20,
            page_size=PAGE,
            num_blocks=16,
            lora_backend="triton" if triton else "torch",
        )
        base_ref, good_ref = greedy(runner, [(BASE, -1, TABLES[0]), (GOOD, 1, TABLES[1])])
        poison(runner.lora_backend.pool)
        base, good, bad = greedy(runner, [(BASE, -1, TABLES[0]), (GOOD, 1, TABLES[1]), (BAD, 0, TABLES[2])])
        # the base request again, on the pages the NaN request just wrote (stale past its context)
        (base_again,) = greedy(runner, [(BASE, -1, TABLES[2])])
    finally:
        run_triton_on_cpu(False)
    failures = []
    if all(bool(torch.isfinite(b).all()) for b in bad):
        failures.append("the poisoned slot's logits are finite: the poison never reached the forward")
    for name, got, want in (
        ("base beside the NaN slot", base, base_ref),
        ("slot 1 beside the NaN slot", good, good_ref),
        ("base on the NaN request's pages", base_again, base_ref),
    ):
        err = same(got, want)
        if not err < 1e-4:
            failures.append(f"{name}: max rel err {err:.2e} against the clean run")
    return failures


def main(path: str) -> int:
    failed = 0
    for model in SHAPES:
        failures = check(model, path == "triton")
        failed += bool(failures)
        verdict = f"{'; '.join(failures)} FAIL" if failures else "contained ok"
        print(f"{model} {path}: {verdict}")
    if not failed:
        print("checked")
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1] if len(sys.argv) > 1 else "torch") else 0)
