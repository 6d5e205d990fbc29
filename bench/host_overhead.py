"""Host overhead of one decode step: LLMEngine on a tiny random Llama at batch 64 on the CPU.

The tiny model (hidden 64, 2 layers, SmolLM2's tokenizer and vocab) makes the forward cheap,
so what is left of a step is the host work the GPU would otherwise wait for. Per decode step
(every request computing one token) it reports, in ms:

- total: wall time of `LLMEngine.step()`;
- forward: the model itself (`model(...)` + `compute_logits`);
- sample: `LLMEngine._sample` (sampling inputs, sampler, tokens to the host);
- output: `LLMEngine._process_outputs` (stop checks, detokenization, finishing requests);
- schedule_prep: the rest (scheduling, building the step's input tensors, bookkeeping).

Medians over the measured steps; best of `--repeats` runs (the dev machine is shared).

    .venv/bin/python bench/host_overhead.py [--batch 64] [--new-tokens 64] [--vocab N] [--stop-strings]
        [--temperature 0] [--overlap on|off|default] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.inference.default_model import ensure_model  # noqa: E402
from services.inference.engine.config import EngineConfig  # noqa: E402
from services.inference.engine.engine import LLMEngine  # noqa: E402
from services.inference.engine.types import SamplingParams  # noqa: E402
from tests.support.factories import make_tiny_model  # noqa: E402

PHASES = ("total", "forward", "sample", "output", "schedule_prep")


class _Timer:
    def __init__(self):
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed


class _TimedModel:
    """Forwards to the model, adding its time (forward + logits) to a timer."""

    def __init__(self, model, timer: _Timer):
        self._model, self._timer = model, timer
        self.compute_logits = timer.wrap(model.compute_logits)

    def __call__(self, *args, **kwargs):
        return self._timer.wrap(self._model)(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def run_once(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    timers = {name: _Timer() for name in ("forward", "sample", "output", "schedule")}
    engine.runner.model = _TimedModel(engine.runner.model, timers["forward"])
    engine._sample = timers["sample"].wrap(engine._sample)
    engine._process_outputs = timers["output"].wrap(engine._process_outputs)
    scheduled: list = []
    schedule = engine.scheduler.schedule

    def record_schedule():
        batch = schedule()
        scheduled.append(batch)
        return batch

    engine.scheduler.schedule = timers["schedule"].wrap(record_schedule)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    rows: list[dict[str, float]] = []
    batch_size = len(prompts)
    while engine.has_unfinished():
        before = {k: t.spent for k, t in timers.items()}
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        batch = scheduled[-1]
        if len(batch.entries) != batch_size or any(e.num_tokens != 1 for e in batch.entries):
            continue  # prefill or a partly drained batch: not a full decode step
        spent = {k: t.spent - before[k] for k, t in timers.items()}
        rows.append(
            {
                "total": total * 1e3,
                "forward": spent["forward"] * 1e3,
                "sample": spent["sample"] * 1e3,
                "output": spent["output"] * 1e3,
                "schedule_prep": (total - spent["forward"] - spent["sample"] - spent["output"]) * 1e3,
            }
        )
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
    parser.add_argument("--out", default="host_overhead.json")
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
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        if args.overlap != "default" and "overlap_schedule" in fields:
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

    host = best["total"] - best["forward"]
    print(
        f"batch {args.batch} decode, {best['steps']} steps (median of best of {args.repeats} runs), ms/step:"
    )
    for name in PHASES:
        share = f"  ({best[name] / best['total']:.0%})" if name != "total" else ""
        print(f"  {name:>14} {best[name]:7.3f}{share}")
    print(f"  {'host (total - forward)':>14} {host:7.3f}")
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "args": vars(args),
        "overlap_schedule": getattr(config, "overlap_schedule", None),
        "ms_per_step": {k: round(best[k], 4) for k in PHASES},
        "host_ms_per_step": round(host, 4),
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
