"""Mixed-step graphs (engine/mixed_graphs.py) against the eager step, on one runner.

1. Lockstep: each scripted mixed step (decodes + prefill chunks at offsets, token counts across the
   buckets, no adapter / a few / more than MANY_ADAPTERS) runs eagerly and then through the pieces
   on the same KV state; logits are compared (relative error, argmax agreement).
2. Greedy: the same requests (random prompts, chunked prefill, decodes beside chunks, one adapter
   each) are generated twice with greedy sampling, pieces off and on, in disjoint KV blocks; the
   tokens must be identical, or part only where the eager run's top two logits were a near-tie
   (bf16 matmuls of a padded bucket may round differently from the unpadded step's).

Run on a tiny random model: `PYTHONPATH=protos python3 -m loraplex.bench.mixed_graph_check [--device cuda]
[--out DIR]` (CPU: the pieces run eagerly; CUDA: captured, bf16), which prints a table and writes
mixed_graph_check.json.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from loraplex.bench.random_runner import TINY, build_runner
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.lora_configs import MANY_ADAPTERS
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.scheduled_batch import SeqChunk

PAGE = 16


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


LOCKSTEP_SEQS = 32


def lockstep_blocks_per_seq(cap: int) -> int:
    return -(-(cap + 96) // PAGE)


def lockstep(runner: ModelRunner, base_block: int, seed: int = 0) -> dict:
    """Scripted mixed steps, eager then pieces on the same KV state: worst relative error, argmax
    agreement."""
    graphs = runner.mixed_graphs
    assert graphs is not None, "capture_mixed_graphs first"
    slots = getattr(getattr(runner.lora_backend, "pool", None), "slots", 0)
    vocab = runner.config.vocab_size
    rnd = random.Random(seed)
    cap = graphs.max_tokens
    max_seqs = runner.sample_indices.shape[0]
    cases = []
    for distinct in sorted({0, min(slots, 3), min(slots, MANY_ADAPTERS + 4)}):
        for nd, chunk, start in (
            (1, 5, 0),
            (7, 40, 16),
            (12, 100, 48),
            (3, 250, 0),
            (20, 300, 32),
            (30, cap - 40, 0),
        ):
            if chunk < 2 or nd + chunk > cap or distinct > nd + 1 or nd + 1 > max_seqs:
                continue
            cases.append((nd, chunk, start, distinct))
    worst, agree, total, per_case = 0.0, 0, 0, []
    blocks = lockstep_blocks_per_seq(cap)
    for nd, chunk, start, distinct in cases:

        def table(seq: int) -> list[int]:  # regions are reused across cases: each writes before it reads
            return list(range(base_block + seq * blocks, base_block + (seq + 1) * blocks))

        steps = [
            SeqChunk([rnd.randrange(vocab)], 60 + i, table(i), i % distinct if distinct else -1, True)
            for i in range(nd)
        ]
        steps.append(
            SeqChunk(
                [rnd.randrange(vocab) for _ in range(chunk)],
                start,
                table(nd),
                (nd % distinct) if distinct else -1,
                True,
            )
        )
        saved, runner.mixed_graphs = runner.mixed_graphs, None
        try:
            want = runner.forward(steps).float().clone()
        finally:
            runner.mixed_graphs = saved
        before = graphs.steps_run
        got = runner.forward(steps).float().clone()
        assert graphs.steps_run == before + 1, "the step did not go through the pieces"
        err = ((got - want).norm() / want.norm()).item()
        same = int((got.argmax(-1) == want.argmax(-1)).sum())
        worst, agree, total = max(worst, err), agree + same, total + got.shape[0]
        per_case.append(
            {
                "decodes": nd,
                "chunk": chunk,
                "start": start,
                "adapters": distinct,
                "bucket": graphs.key(nd + chunk, min(distinct, nd + 1))[0],
                "rel_err": err,
            }
        )
    dtype = runner.kv_cache.dtype
    return {
        "cases": per_case,
        "worst_rel_err": worst,
        "argmax_agree": agree,
        "rows": total,
        "ok": worst < _tol(dtype) and agree >= total - max(1, total // 50),
    }


def greedy(
    runner: ModelRunner,
    base_block: int,
    *,
    num_requests: int,
    distinct: int,
    chunk: int,
    new_tokens: int,
    seed: int = 0,
) -> dict:
    """Greedy generation of the same requests with the pieces off, then on; compares the tokens."""
    vocab = runner.config.vocab_size
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(vocab) for _ in range(rnd.randint(20, 3 * chunk))] for _ in range(num_requests)]
    per = -(-(3 * chunk + new_tokens) // PAGE) + 1
    runs = {}
    saved = runner.mixed_graphs
    for on in (False, True):
        region = base_block + (num_requests * per if on else 0)
        runner.mixed_graphs = saved if on else None
        before = saved.steps_run
        try:
            runs[on] = _generate(runner, prompts, region, per, distinct, chunk, new_tokens)
        finally:
            runner.mixed_graphs = saved
        if on:
            assert saved.steps_run > before, "no step went through the pieces"
    (off_tokens, off_gaps), (on_tokens, _) = runs[False], runs[True]
    diverged = []
    for i, (a, b) in enumerate(zip(off_tokens, on_tokens, strict=True)):
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is not None:
            diverged.append({"request": i, "at": at, "top2_gap": off_gaps[i][at]})
    near_tie = all(d["top2_gap"] < 0.05 for d in diverged)
    return {
        "requests": num_requests,
        "adapters": distinct,
        "chunk": chunk,
        "identical": not diverged,
        "diverged": diverged,
        "ok": not diverged or near_tie,
    }


def _generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    region: int,
    per: int,
    distinct: int,
    chunk: int,
    new_tokens: int,
) -> tuple[list[list[int]], list[list[float]]]:
    """A tiny scheduler: every step runs all decodes plus the next chunk of the first unfinished prompt."""
    n = len(prompts)
    done = [0] * n  # prompt tokens computed
    out: list[list[int]] = [[] for _ in range(n)]
    gaps: list[list[float]] = [[] for _ in range(n)]

    def table(i: int) -> list[int]:
        return list(range(region + i * per, region + (i + 1) * per))

    def slot(i: int) -> int:
        return i % distinct if distinct else -1

    while any(len(o) < new_tokens for o in out):
        chunks, owners = [], []
        for i in range(n):
            if done[i] == len(prompts[i]) and 0 < len(out[i]) < new_tokens:
                pos = len(prompts[i]) + len(out[i]) - 1
                chunks.append(SeqChunk([out[i][-1]], pos, table(i), slot(i), True))
                owners.append(i)
        pending = next((i for i in range(n) if done[i] < len(prompts[i])), None)
        if pending is not None:
            start = done[pending]
            take = prompts[pending][start : start + chunk]
            sample = start + len(take) == len(prompts[pending])
            chunks.append(SeqChunk(take, start, table(pending), slot(pending), sample))
            done[pending] += len(take)
            if sample:
                owners.append(pending)
        logits = runner.forward(chunks).float()
        top2 = logits.topk(2, dim=-1)
        for row, i in enumerate(owners):
            out[i].append(int(top2.indices[row, 0]))
            v = top2.values[row]
            gaps[i].append(float((v[0] - v[1]) / v[0].abs().clamp(min=1e-6)))
    return out, gaps


GREEDY_NEW_TOKENS = 12


def blocks_needed(cap: int, slots: int, chunk: int = 128) -> int:
    """KV blocks `run_all` writes (from `base_block`); positions reach max(cap + 96, 3 * chunk + 12)."""
    requests = max(6, min(slots, MANY_ADAPTERS + 8) + 1)
    return LOCKSTEP_SEQS * lockstep_blocks_per_seq(cap) + 2 * requests * (
        -(-(3 * chunk + GREEDY_NEW_TOKENS) // PAGE) + 1
    )


def run_all(runner: ModelRunner, base_block: int, slots: int, chunk: int = 128) -> dict:
    result = {"lockstep": lockstep(runner, base_block)}
    used = base_block + LOCKSTEP_SEQS * lockstep_blocks_per_seq(runner.mixed_graphs.max_tokens)
    result["greedy"] = []
    max_seqs = runner.sample_indices.shape[0]
    for distinct in sorted({0, min(slots, 4), min(slots, MANY_ADAPTERS + 8, max_seqs - 1)}):
        num = min(max(6, distinct + 1), max_seqs)
        result["greedy"].append(
            greedy(
                runner, used, num_requests=num, distinct=distinct, chunk=chunk, new_tokens=GREEDY_NEW_TOKENS
            )
        )
    result["ok"] = result["lockstep"]["ok"] and all(g["ok"] for g in result["greedy"])
    return result


def print_table(result: dict) -> None:
    lock = result["lockstep"]
    print("| check | steps / requests | adapters | result | ok |\n| --- | ---: | ---: | --- | --- |")
    print(
        f"| lockstep pieces == eager | {len(lock['cases'])} | - | worst rel err {lock['worst_rel_err']:.2e}, "
        f"argmax {lock['argmax_agree']}/{lock['rows']} | {lock['ok']} |"
    )
    for g in result["greedy"]:
        what = "identical" if g["identical"] else f"diverged at {[d['at'] for d in g['diverged']]}"
        print(f"| greedy pieces on/off | {g['requests']} | {g['adapters']} | {what} | {g['ok']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (pieces run eagerly) or cuda (captured, bf16)")
    add_out_argument(parser)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    runner = build_runner(
        TINY,
        dtype=torch.bfloat16 if cuda else torch.float32,
        device=torch.device(args.device),
        slots=20,
        rank=8,
        max_num_tokens=128,
        max_num_seqs=64,
        context_length=1024,
        page_size=PAGE,
        num_blocks=4096,
        lora_backend="triton" if cuda else "torch",
    )
    runner.capture_mixed_graphs(128, use_graphs=cuda)
    result = run_all(runner, 0, 20, chunk=24)
    print_table(result)
    write_json(args.out, "mixed_graph_check", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
