"""Speculative decoding's mechanics on random weights (issue 58's GPU rows): inter-token latency with
speculation on against off at batch 1 / 8 / 32, for the base model and with 8 distinct adapters in the
batch, and throughput at batch 64 (where speculation backs off), on a Llama-3.1-8B-shaped engine.

    PYTHONPATH=protos python3 -m loraplex.bench.speculation [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.speculation --tiny      # CPU smoke run

Random weights never agree with a draft, so acceptance is forced (`Speculator.force_acceptance`: each
of the K = 4 draft tokens accepted with probability 0.7, up to the first rejection): the step costs
are real, the tokens are not the model's. One engine serves both modes (speculation off = the default
engine, overlap scheduling included). The acceptance of real drafts on real weights is measured on the
CPU by tests/integration/test_speculative_engine.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from loraplex.bench import harness as h
from loraplex.bench.results import add_out_argument, write_json

RATE, K = 0.7, 4
ADAPTERS = 8


def _engine(root: Path, tiny: bool, device: torch.device):
    from loraplex.bench.serving_setup import LLAMA_8B
    from loraplex.bench.workload_targets import TINY, _ensure_files
    from loraplex.services.inference.engine.build import build_llm_engine
    from loraplex.services.inference.server_args import ServerArgs

    shape = TINY if tiny else LLAMA_8B
    model, paths = _ensure_files(root, shape, ADAPTERS, 16, device.type)
    kw = dict(
        model_path=str(model),
        device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        lora_paths=tuple(f"s{i}={p}" for i, p in enumerate(paths)),
        speculative_algorithm="ngram",
        speculative_num_draft_tokens=K,
        context_length=2048,
        max_total_tokens=65536 if tiny else 200_000,
    )
    args = ServerArgs.from_fields(**kw)
    engine, _ = build_llm_engine(args.engine, args.lora)
    return engine, shape["vocab_size"]


def _run(engine, vocab: int, batch: int, adapters: bool, new_tokens: int, prompt_len: int) -> dict:
    """`batch` requests at once to the end; inter-token latency per request (its decode time over
    its tokens after the first), the batch's output tokens/s, and the tokens a decoding request
    emits per step (1 without speculation, up to K + 1 with it; first tokens not counted)."""
    from loraplex.services.inference.engine.types import SamplingParams

    rnd = random.Random(batch)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for i in range(batch):
        prompt = [rnd.randrange(1, vocab - 2) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params, f"s{i % ADAPTERS}" if adapters else None)
    t0 = time.perf_counter()
    runs = decoded = 0  # a decoding request's emissions in a step, and their tokens
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.new_token_ids)
            if not n:
                continue
            if out.request_id in first:
                runs, decoded = runs + 1, decoded + n
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] = count.get(out.request_id, 0) + n
    elapsed = time.perf_counter() - t0
    itl = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    return dict(
        itl_ms=1e3 * sum(itl) / len(itl),
        tok_s=sum(count.values()) / elapsed,
        tokens_per_step=decoded / max(runs, 1),
    )


def run(root: Path, tiny: bool, device: torch.device, batches=(1, 8, 32), throughput_batch: int = 64) -> dict:
    engine, vocab = _engine(root, tiny, device)
    spec = engine.speculator
    spec.force_acceptance(RATE)
    new_tokens, prompt_len = (16, 8) if tiny else (96, 256)
    out: dict = {}

    def both(engine, batch: int, adapters: bool) -> dict:
        engine.speculator = None
        _run(engine, vocab, batch, adapters, 4, prompt_len)  # warm this shape
        off = _run(engine, vocab, batch, adapters, new_tokens, prompt_len)
        engine.speculator = spec
        # Warm the speculative path too: on a cold kernel cache the first batch-64 window with it paid a
        # one-time stall (H100, 2026-12-08: 0.76x tok/s at the same inter-token latency; 1.00x rerun).
        _run(engine, vocab, batch, adapters, 4, prompt_len)
        drafted, accepted = sum(spec.stats.drafted.values()), sum(spec.stats.accepted.values())
        on = _run(engine, vocab, batch, adapters, new_tokens, prompt_len)
        drafted = sum(spec.stats.drafted.values()) - drafted
        accepted = sum(spec.stats.accepted.values()) - accepted
        row = dict(
            off=off,
            on=on,
            itl_on_vs_off=on["itl_ms"] / off["itl_ms"],
            tok_s_on_vs_off=on["tok_s"] / off["tok_s"],
            drafted=drafted,
            accepted=accepted,
        )
        h.log(
            f"speculation batch {batch}{' x 8 adapters' if adapters else ''}: inter-token "
            f"{off['itl_ms']:.2f} -> {on['itl_ms']:.2f} ms ({row['itl_on_vs_off']:.2f}x), "
            f"{off['tok_s']:.0f} -> {on['tok_s']:.0f} tok/s, {drafted} draft tokens "
            f"({accepted / max(drafted, 1):.0%} accepted, {on['tokens_per_step']:.2f} tokens/request/step)"
        )
        return row

    for adapters in (False, True):
        for b in batches:
            out[f"{'lora' if adapters else 'base'}_{b}"] = both(engine, b, adapters)
    out[f"base_{throughput_batch}"] = both(engine, throughput_batch, False)
    out["rate"], out["k"] = RATE, K
    del engine
    h.free(device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = h.suite_parser("speculation", __doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help="the random model and adapters (kept)")
    add_out_argument(p)
    o = p.parse_args(argv)
    device = h.pick_device(o.device)
    root = o.workdir or Path.home() / ".cache" / "loraplex" / f"speculation-{'tiny' if o.tiny else 'full'}"
    result = run(
        root, o.tiny, device, batches=(1, 4) if o.tiny else (1, 8, 32), throughput_batch=8 if o.tiny else 64
    )
    rows = [
        [
            k,
            h.fmt(v["off"]["itl_ms"]),
            h.fmt(v["on"]["itl_ms"]),
            h.fmt(v["itl_on_vs_off"]),
            h.fmt(v["tok_s_on_vs_off"]),
            h.fmt(v["accepted"] / v["drafted"]) if v["drafted"] else "-",
            h.fmt(v["on"]["tokens_per_step"]),
        ]
        for k, v in result.items()
        if isinstance(v, dict)
    ]
    header = ["case", "ITL off ms", "ITL on ms", "ITL on/off", "tok/s on/off", "accepted", "tokens/step"]
    h.print_table(header, rows)
    write_json(o.out, "speculation", dict(result, meta=h.meta(device, o.tiny)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
