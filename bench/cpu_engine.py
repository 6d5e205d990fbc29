"""CPU throughput: our engine vs transformers `generate` on SmolLM2-135M, batch 1 and 16.

Same prompts, greedy, float32, a fixed number of new tokens (EOS ignored by both: ours with
`ignore_eos`, transformers with `min_new_tokens`). tokens/s = new tokens / wall time of the
whole generation (prefill included); best of `--repeats` runs, the two interleaved, since the
dev machine is shared. Prints a table and writes JSON.

    .venv/bin/python -m loraplex.bench.cpu_engine [--new-tokens 64] [--repeats 3] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import time
from pathlib import Path

import torch

from loraplex.bench.results import add_out_argument, write_json

PROMPTS = [
    "List 3 countries and their capitals.",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain what a hash table is in one paragraph.",
    "The quick brown fox",
    "What is the boiling point of water at sea level?",
    "Translate to French: I would like a cup of coffee, please.",
    "Give me three tips for learning to play the guitar as an adult beginner.",
    "Once upon a time,",
    "Summarize the plot of Romeo and Juliet.",
    "1, 2, 3, 4,",
    "Why is the sky blue?",
    "Name five fruits that are red.",
    "How do I reverse a list in Python?",
    "The history of the Roman Empire began",
    "Describe a cat to someone who has never seen one.",
]


class OurEngine:
    def __init__(self, model_dir: Path):
        from loraplex.services.inference.engine.config import EngineConfig
        from loraplex.services.inference.engine.engine import LLMEngine

        config = EngineConfig(
            model_path=str(model_dir),
            device=torch.device("cpu"),
            dtype="float32",
            max_total_tokens=16384,
            context_length=2048,
        )
        self.engine = LLMEngine.from_config(config)

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        from loraplex.services.inference.engine.types import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        results = self.engine.generate(prompts, params)
        return time.perf_counter() - start, [r.token_ids for r in results]


class Transformers:
    def __init__(self, model_dir: Path, pad_token_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = pad_token_id

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad,
            )
            elapsed = time.perf_counter() - start
        return elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_out_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from loraplex.services.inference.default_model import ensure_model

    model_dir = ensure_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ours, hf = OurEngine(model_dir), Transformers(model_dir, tok.pad_token_id or 0)
    for runner in (ours, hf):  # warm-up
        runner.run([tok(PROMPTS[0]).input_ids], 4)
    rows = []
    for batch in (1, 16):
        prompts = [tok(p).input_ids for p in PROMPTS[:batch]]
        ours_s = hf_s = float("inf")
        for _ in range(args.repeats):
            t, ours_out = ours.run(prompts, args.new_tokens)
            ours_s = min(ours_s, t)
            t, hf_out = hf.run(prompts, args.new_tokens)
            hf_s = min(hf_s, t)
        tokens = batch * args.new_tokens
        # transformers' min_new_tokens bans EOS where ours samples past it: compare up to our first EOS
        cuts = [next((i for i, t in enumerate(o) if t == tok.eos_token_id), len(o)) for o in ours_out]
        same = sum(a[:c] == b[:c] for a, b, c in zip(ours_out, hf_out, cuts, strict=True))
        rows.append(
            dict(
                batch=batch,
                new_tokens=args.new_tokens,
                engine_s=ours_s,
                engine_tok_s=tokens / ours_s,
                transformers_s=hf_s,
                transformers_tok_s=tokens / hf_s,
                speedup=hf_s / ours_s,
                greedy_equal=f"{same}/{batch}",
            )
        )
    print(
        "| batch | new tokens | engine tok/s | transformers tok/s | speedup | greedy outputs equal (to EOS) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['new_tokens']} | {r['engine_tok_s']:.1f} | {r['transformers_tok_s']:.1f} "
            f"| {r['speedup']:.2f}x | {r['greedy_equal']} |"
        )
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        model=str(model_dir),
    )
    print(f"\n{meta}")
    write_json(args.out, "cpu_engine", {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
