"""Constrained decoding's cost in a mixed multi-LoRA batch (issue 36's speed goals).

    python -m loraplex.bench.structured --shape 8b --batch 64 --adapters 8 --tokenizer DIR   # H200
    python -m loraplex.bench.structured                                                      # CPU, tiny

Builds the server's engine (build_engine: loader, LoRA pool, CUDA graphs, overlap scheduling) over a
random-weight model of the chosen shape with `--adapters` random rank-16 adapters, and the real BPE
tokenizer from `--tokenizer` (default: the embedded SmolLM2's; the 8B shape keeps its 128256-row
vocabulary, the ids past the tokenizer's are masked off). Rows are spread over the adapters and
the base model. It measures, driving `LLMEngine.step()` itself:

- decode step time (median) with every row free, then with half the rows under a JSON schema (an
  object holding an array of >= 1000 ordinary records, so no row can finish while timed), and the
  ratio (goal <= 1.10 on the H200);
- the free rows' step time in that mixed batch versus the all-free batch is the same step (they
  share it); the part a free row pays is the mask step's time, reported as `mask_ms` (the engine's
  mask of the constrained rows: matcher fill on the host + the device copy and masked_fill), which a
  batch without constrained rows never runs;
- first-token delay of a request under a new schema (compile + one step) and under a cached one
  (p50 over `--schemas` random schemas of bench/random_schemas.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loraplex.bench.random_schemas import random_schema
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B, write_adapters, write_model_dir
from loraplex.services.inference.engine.types import Constraint, SamplingParams

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=49152,
)
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "score", "ok"],
    "additionalProperties": False,
}
LONG_SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "items": RECORD, "minItems": 1000}},
    "required": ["rows"],
    "additionalProperties": False,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(root: Path, shape: dict, tokenizer_dir: Path, adapters: int, device: str) -> tuple[Path, list]:
    model = write_model_dir(root / "model", shape=shape, device=device)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for old in model.glob("tokenizer*"):
        old.unlink()
    tok.save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(
        json.dumps(dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    )
    return model, write_adapters(root / "adapters", model, adapters, shape=shape, rank=16, device=device)


def build(model: Path, adapter_dirs: list[Path], opts):
    from loraplex.services.inference.engine.async_engine import AsyncEngine
    from loraplex.services.inference.engine.build import build_engine
    from loraplex.services.inference.server_args import ServerArgs

    cuda = torch.cuda.is_available() and opts.device != "cpu"
    args = ServerArgs.from_fields(
        model_path=str(model),
        dtype="bfloat16" if cuda else "float32",
        device="cuda" if cuda else "cpu",
        max_loras_per_batch=max(1, len(adapter_dirs)),
        max_lora_rank=16,
        lora_target_modules=("all",),
        lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(adapter_dirs)),
        max_running_requests=opts.batch,
        cuda_graph_max_bs=opts.batch,
        context_length=2048,
        chunked_prefill_size=4096,
        max_num_batched_tokens=4096 + opts.batch,
        mem_fraction_static=0.85,
        lora_backend="triton" if cuda else "torch",
    )
    aengine = build_engine(args.engine, args.lora)
    asyncio.run(AsyncEngine.shutdown(aengine))  # drive LLMEngine.step() from here
    return aengine.engine


def _step_until_decoding(engine, ids: list[str]) -> None:
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                raise RuntimeError(f"{out.request_id} ended ({out.finish_reason}) before the timed steps")
            pending.discard(out.request_id)


def decode_ms(engine, prompt: list[int], opts, constrained_every: int | None) -> tuple[float, float]:
    """Median decode step time (ms) of a full batch; rows i % constrained_every == 0 under LONG_SCHEMA.
    Also the median time of the engine's mask step (0 without constrained rows)."""
    names = [None] + [f"a{i}" for i in range(opts.adapters)]
    ids = []
    constraint = Constraint("json_schema", json.dumps(LONG_SCHEMA))
    for i in range(opts.batch):
        on = constrained_every is not None and i % constrained_every == 0
        params = SamplingParams(
            max_new_tokens=1500, temperature=0.0, ignore_eos=True, constraint=constraint if on else None
        )
        rid = f"r{i}-{random.getrandbits(32):08x}"
        engine.add_request(rid, prompt, params, names[i % len(names)])
        ids.append(rid)
    _step_until_decoding(engine, ids)
    mask_times: list[float] = []

    def timed_mask(phase: str, started: float, result) -> None:
        if phase == "mask":  # the grammar mask's own time, device work included
            _sync(result.device)
            mask_times.append(time.perf_counter() - started)

    engine.step_timer = timed_mask
    device = engine.loaded.device
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(opts.steps):
        _sync(device)
        start = time.perf_counter()
        outs = engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        if any(o.finished for o in outs):
            raise RuntimeError("a row finished during the timed steps")
    engine.step_timer = None
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    mask = 1e3 * statistics.median(mask_times[3:]) if len(mask_times) > 3 else 0.0
    return 1e3 * statistics.median(times), mask


def first_token_ms(engine, prompt: list[int], opts) -> dict[str, float]:
    """Arrival to first token of one request alone: new schema (compile + step) vs the same again."""
    rng = random.Random(1)
    new, cached, compile_ms = [], [], []
    for _ in range(opts.schemas):
        c = Constraint("json_schema", json.dumps(random_schema(rng)))
        for bucket in (new, cached):
            start = time.perf_counter()
            t = time.perf_counter()
            grammar = engine.grammars.compile(c)
            if bucket is new:
                compile_ms.append(1e3 * (time.perf_counter() - t))
            rid = f"ft-{random.getrandbits(32):08x}"
            engine.add_request(rid, prompt, SamplingParams(max_new_tokens=1, constraint=c), grammar=grammar)
            while engine.has_unfinished():
                engine.step()
            bucket.append(1e3 * (time.perf_counter() - start))
    return {
        "new_schema_p50_ms": statistics.median(new),
        "cached_schema_p50_ms": statistics.median(cached),
        "compile_p50_ms": statistics.median(compile_ms),
        "compile_max_ms": max(compile_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["tiny", "8b"], default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schemas", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a HF tokenizer directory")
    add_out_argument(parser)
    opts = parser.parse_args(argv)
    if opts.tokenizer is None:
        from loraplex.services.inference.default_model import ensure_model

        opts.tokenizer = ensure_model()
    cuda = torch.cuda.is_available() and opts.device != "cpu"
    if not cuda:
        torch.set_num_threads(1)
    shape = LLAMA_8B if opts.shape == "8b" else TINY
    root = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    try:
        model, adapters = make_model(root, shape, opts.tokenizer, opts.adapters, "cuda" if cuda else "cpu")
        engine = build(model, adapters, opts)
        prompt = engine.tokenizer("Write the records as JSON:").input_ids * 4
        engine.grammars.compile(Constraint("json_schema", json.dumps(LONG_SCHEMA)))  # not timed here
        free_ms, _ = decode_ms(engine, prompt, opts, None)
        mixed_ms, mask_ms = decode_ms(engine, prompt, opts, 2)
        first = first_token_ms(engine, prompt, opts)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {
        "shape": opts.shape,
        "device": "cuda" if cuda else "cpu",
        "batch": opts.batch,
        "adapters": opts.adapters,
        "overlap": engine._overlap,
        "all_free_step_ms": free_ms,
        "half_constrained_step_ms": mixed_ms,
        "ratio": mixed_ms / free_ms,
        "mask_ms": mask_ms,
        **first,
    }
    print(f"{'':34s}{'ms':>10s}")
    for key in ("all_free_step_ms", "half_constrained_step_ms", "mask_ms"):
        print(f"{key:34s}{res[key]:10.2f}")
    print(f"{'ratio (goal <= 1.10)':34s}{res['ratio']:10.3f}")
    for key in ("new_schema_p50_ms", "cached_schema_p50_ms", "compile_p50_ms", "compile_max_ms"):
        print(f"{key:34s}{res[key]:10.2f}")
    write_json(opts.out, "structured", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
