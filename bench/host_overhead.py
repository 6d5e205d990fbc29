"""Host overhead of one decode step: LLMEngine on a tiny random Llama at batch 64 on the CPU.

The tiny model (hidden 64, 2 layers, SmolLM2's tokenizer and vocab) makes the forward cheap,
so what is left of a step is the host work the GPU would otherwise wait for. Per decode step
(every request computing one token) it reports, in ms, from the engine's step timer
(`LLMEngine.step_timer`) and torch module hooks on the model:

- total: wall time of `LLMEngine.step()`;
- model: the decoder stack (`model(...)`), what a GPU would run;
- schedule: `Scheduler.schedule`;
- forward_prep: the rest of the runner's forward (the step's input tensors, the logits);
- sample: sampling inputs, sampler;
- output: stop checks, detokenization, finishing requests;
- other: the rest (tokens to the host, bookkeeping).

Medians over the measured steps; best of `--repeats` runs (the dev machine is shared).

    .venv/bin/python -m loraplex.bench.host_overhead [--batch 64] [--new-tokens 64] [--vocab N]
        [--stop-strings] [--temperature 0] [--overlap on|off|default] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from loraplex.bench.results import add_out_argument, write_json
from loraplex.services.inference.default_model import ensure_model
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import SamplingParams
from tests.support.factories import make_tiny_model

PHASES = ("total", "model", "schedule", "forward_prep", "sample", "output", "other")


class StepClock:
    """Seconds per phase of the current step: the engine's step timer plus the model's own time
    (a forward pre-hook and hook on the model module)."""

    def __init__(self, engine: LLMEngine):
        self.spent: dict[str, float] = defaultdict(float)
        self.batch = None
        self._model_start = 0.0
        engine.step_timer = self.phase_done
        engine.runner.model.register_forward_pre_hook(self._model_starts)
        engine.runner.model.register_forward_hook(self._model_ends)

    def phase_done(self, phase: str, started: float, result: object) -> None:
        self.spent[phase] += time.perf_counter() - started
        if phase == "schedule":
            self.batch = result

    def _model_starts(self, module, args) -> None:
        self._model_start = time.perf_counter()

    def _model_ends(self, module, args, output) -> None:
        self.spent["model"] += time.perf_counter() - self._model_start

    def reset(self) -> None:
        self.spent.clear()
        self.batch = None


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    clock = StepClock(engine)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    rows: list[dict[str, float]] = []
    batch_size = len(prompts)
    while engine.has_unfinished():
        clock.reset()
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        batch = clock.batch
        if len(batch.entries) != batch_size or any(e.num_tokens != 1 for e in batch.entries):
            continue  # prefill or a partly drained batch: not a full decode step
        s = clock.spent
        row = {
            "total": total,
            "model": s["model"],
            "schedule": s["schedule"],
            "forward_prep": s["forward"] - s["model"],
            "sample": s["sample"],
            "output": s["output"],
        }
        row["other"] = total - sum(s[k] for k in ("schedule", "forward", "sample", "output"))
        rows.append({k: v * 1e3 for k, v in row.items()})
    return {k: statistics.median(r[k] for r in rows) for k in PHASES} | {"steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="model vocab (ids 0..N-1 of the tokenizer); 0 = the tokenizer's whole 49,152. "
        "A small one shrinks the lm_head and argmax, which are device work on a GPU",
    )
    parser.add_argument("--stop-strings", action="store_true", help="give every request two stop strings")
    parser.add_argument("--overlap", choices=("default", "on", "off"), default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    add_out_argument(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "tiny", tokenizer_from=ensure_model(), vocab_size=args.vocab or None
        )
        options = dict(
            model_path=str(model_dir),
            device=torch.device("cpu"),
            dtype="float32",
            max_running_requests=max(args.batch, 1),
            max_total_tokens=args.batch * 256,
            context_length=1024,
        )
        if args.overlap != "default":
            options["overlap_schedule"] = args.overlap == "on"
        config = EngineConfig(**options)
        gen = torch.Generator().manual_seed(0)
        vocab = args.vocab or 49152
        prompts = [
            torch.randint(min(100, vocab // 2), vocab, (args.prompt_tokens,), generator=gen).tolist()
            for _ in range(args.batch)
        ]
        stop = ("\n\nUser:", "<|stop|>") if args.stop_strings else ()
        params = SamplingParams(
            max_new_tokens=args.new_tokens, temperature=args.temperature, seed=1, ignore_eos=True, stop=stop
        )
        results = []
        for _ in range(args.repeats):
            engine = LLMEngine.from_config(config)
            results.append(run_once(engine, prompts, params))
        best = min(results, key=lambda r: r["total"])

    host = best["total"] - best["model"]
    print(
        f"batch {args.batch} decode, {best['steps']} steps (median of best of {args.repeats} runs), ms/step:"
    )
    for name in PHASES:
        share = f"  ({best[name] / best['total']:.0%})" if name != "total" else ""
        print(f"  {name:>14} {best[name]:7.3f}{share}")
    print(f"  {'host (total - model)':>14} {host:7.3f}")
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "args": vars(args),
        "overlap_schedule": config.overlap_schedule,
        "ms_per_step": {k: round(best[k], 4) for k in PHASES},
        "host_ms_per_step": round(host, 4),
        "runs": results,
    }
    write_json(args.out, "host_overhead", record)


if __name__ == "__main__":
    main()
