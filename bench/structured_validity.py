"""Every finished constrained output validates: random JSON schemas, regexes and choices on the
embedded SmolLM2 (CPU or GPU), with and without an adapter, greedy and sampled (issue 36's
correctness goal; `make test` runs a smaller count on the tiny model).

    python -m loraplex.bench.structured_validity --schemas 200

Each schema (bench/random_schemas.py) is asked for twice in one continuous batch, greedy and
sampled (temperature 1), half of them under a random rank-8 adapter. An output that ends with
"stop" must parse and validate with `jsonschema`; one that ends with "length" counts as such
(the goal: few, with a few hundred tokens). Prints the counts and token statistics; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jsonschema
import torch

from loraplex.bench.random_schemas import random_schema
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import write_adapters
from loraplex.services.inference.engine.chat import render_chat
from loraplex.services.inference.engine.types import Constraint, SamplingParams

REGEXES = [
    r"[A-Z][a-z]{2,9}",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"#[0-9a-f]{6}",
]
CHOICES = [("positive", "negative", "neutral"), ("cat", "dog"), ("A", "B", "C", "D")]


def smollm2_shape(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    return {k: cfg[k] for k in keys} | {"vocab_size": cfg["vocab_size"]}


def build(model_dir: Path, adapter: Path, batch: int):
    from loraplex.services.inference.engine.build import build_llm_engine
    from loraplex.services.inference.server_args import ServerArgs

    cuda = torch.cuda.is_available()
    args = ServerArgs.from_fields(
        model_path=str(model_dir),
        device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32",
        lora_paths=(f"ad={adapter}",),
        max_loras_per_batch=1,
        max_lora_rank=8,
        max_running_requests=batch,
        context_length=2048,
        max_total_tokens=batch * 1024,
    )
    return build_llm_engine(args.engine, args.lora)[0]


def prompt_ids(engine, task: str) -> list[int]:
    return render_chat(engine.tokenizer, [{"role": "user", "content": task}], True)


def run(engine, jobs: list[tuple], max_tokens: int) -> list:
    """jobs: (prompt ids, Constraint, temperature, seed, adapter) -> (text, token ids, finish reason),
    all in one continuous batch (the engine admits up to --batch at a time)."""
    ids = []
    for n, (prompt, c, temp, seed, adapter) in enumerate(jobs):
        rid = f"v{n}"
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temp, seed=seed, constraint=c)
        engine.check_request(prompt, params)
        engine.add_request(rid, prompt, params, adapter)
        ids.append(rid)
    texts: dict[str, list[str]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id].append(out.new_text)
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason or ""
                if len(reasons) % 40 == 0:
                    print(f"{len(reasons)}/{len(ids)} done", flush=True)
    return [("".join(texts[rid]), tokens[rid], reasons[rid]) for rid in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    opts = parser.parse_args(argv)
    from loraplex.services.inference.default_model import ensure_model

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    model_dir = ensure_model()
    root = Path(tempfile.mkdtemp(prefix="bench-validity-"))
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        adapter = write_adapters(root, model_dir, 1, shape=smollm2_shape(model_dir), rank=8, device=device)[0]
        engine = build(model_dir, adapter, opts.batch)
        rng = random.Random(opts.seed)
        jobs, checks = [], []
        for i in range(opts.schemas):
            schema = random_schema(rng)
            # A short prompt (the schema is enforced by the mask, not read by the model): prefill of a
            # few hundred schema tokens per request would dominate a CPU run.
            task = "Reply with a JSON object."
            c = Constraint("json_schema", json.dumps(schema))
            for temp in (0.0, 1.0):
                jobs.append((prompt_ids(engine, task), c, temp, i, "ad" if i % 2 else None))
                checks.append(("json", schema))
        for i in range(max(2, opts.schemas // 10)):
            regex = REGEXES[i % len(REGEXES)]
            choices = CHOICES[i % len(CHOICES)]
            for temp in (0.0, 1.0):
                adapter_name = "ad" if i % 2 else None
                jobs.append(
                    (prompt_ids(engine, "Answer:"), Constraint("regex", regex), temp, i, adapter_name)
                )
                checks.append(("regex", regex))
                jobs.append(
                    (
                        prompt_ids(engine, "Pick one."),
                        Constraint("choice", choices=choices),
                        temp,
                        i,
                        adapter_name,
                    )
                )
                checks.append(("choice", choices))
        start = time.perf_counter()
        outs = run(engine, jobs, opts.max_tokens)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counts: dict[str, dict[str, int]] = {}
    invalid = []
    stop_tokens = []
    for (kind, spec), (_, _, temp, _, adapter_name), out in zip(checks, jobs, outs, strict=True):
        key = f"{kind} {'greedy' if temp == 0 else 'sampled'} {'adapter' if adapter_name else 'base'}"
        row = counts.setdefault(key, {"stop_valid": 0, "stop_invalid": 0, "length": 0, "other": 0})
        text, token_ids, reason = out
        if reason == "length":
            row["length"] += 1
            continue
        if reason != "stop":
            row["other"] += 1
            continue
        stop_tokens.append(len(token_ids))
        try:
            if kind == "json":
                jsonschema.validate(json.loads(text), spec)
            elif kind == "regex":
                assert re.fullmatch(spec, text), text
            else:
                assert text in spec, text
            row["stop_valid"] += 1
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            row["stop_invalid"] += 1
            invalid.append({"kind": kind, "spec": spec, "text": text, "why": str(exc)[:200]})
    print(f"{'':28s}{'stop+valid':>11s}{'stop+INVALID':>13s}{'length':>8s}{'other':>7s}")
    for key in sorted(counts):
        r = counts[key]
        print(f"{key:28s}{r['stop_valid']:11d}{r['stop_invalid']:13d}{r['length']:8d}{r['other']:7d}")
    tokens = {
        "median": statistics.median(stop_tokens) if stop_tokens else 0,
        "max": max(stop_tokens, default=0),
    }
    print(f"tokens of stopped outputs: median {tokens['median']}, max {tokens['max']}; {seconds:.0f} s")
    write_json(
        opts.out,
        "structured_validity",
        {
            "schemas": opts.schemas,
            "max_tokens": opts.max_tokens,
            "counts": counts,
            "invalid": invalid,
            "stop_tokens": tokens,
            "seconds": seconds,
        },
    )
    return 1 if invalid else 0


if __name__ == "__main__":
    raise SystemExit(main())
