"""Decode step of random Qwen3-8B and Gemma-2-9B shaped models: batch 64 against the memory floor, and
8 distinct adapters against the base model.

    PYTHONPATH=protos python3 -m loraplex.bench.families [--batch 64] [--adapters 8] [--context 1024]
        [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.families --tiny      # CPU smoke run: tiny shapes, torch LoRA

Each model is a ModelRunner over random weights (bench/random_runner.py FAMILY_SHAPES, bf16) with
`--adapters` random rank-16 all-module adapters resident and the decode CUDA graphs captured as the
engine captures them. A step is `--batch` sequences of `--context` tokens decoding one token each
(the runner's forward, inputs uploaded, graph replayed, logits out), timed over `--steps` steps
after a warm-up. The floor is the bytes a decode step must read over the copy bandwidth measured
here: every weight (the embedding table only where it is tied to the lm_head) plus each layer's
K/V of every sequence (a sliding-window layer reads at most its window). Goals (issue 37): base step
<= 1.3x floor, 8 adapters >= 0.92x the base's speed.
"""

from __future__ import annotations

import argparse
import time

import torch

from loraplex.bench.random_runner import FAMILY_SHAPES, TINY, TINY_FAMILIES, build_runner
from loraplex.bench.results import add_out_argument, write_json
from loraplex.services.inference.engine.scheduler import SeqChunk

PAGE = 16


def kv_bytes(runner, batch: int, context: int) -> int:
    cfg = runner.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv_cache.element_size()
    windows = [
        runner.attention.windows[i] if runner.attention.windows else None for i in range(cfg.num_layers)
    ]
    return sum(batch * min(context, w or context) * per_token for w in windows)


def weight_bytes(runner) -> int:
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # an untied embedding table is only gathered from (batch rows)
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 20 * 2 * src.numel() * 2 / (time.perf_counter() - start)


def step_ms(runner, chunks: list[SeqChunk], steps: int, device: torch.device) -> float:
    for _ in range(3):
        runner.forward(chunks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        runner.forward(chunks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def decode_runner(shape: dict, opts: argparse.Namespace, device: torch.device, graphs: bool):
    """A random-weight ModelRunner of `shape` holding `opts.batch` sequences of `opts.context` tokens
    (bench/moe.py uses it too); returns it with a sequence's page count."""
    pages = -(-(opts.context + 1) // PAGE)
    runner = build_runner(
        shape,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        device=device,
        slots=opts.adapters,
        rank=16,
        max_num_tokens=opts.batch,
        max_num_seqs=opts.batch,
        context_length=pages * PAGE,
        page_size=PAGE,
        num_blocks=opts.batch * pages + 1,
        lora_backend="triton" if device.type == "cuda" else "torch",
    )
    runner.kv_cache.zero_()
    if device.type == "cuda" and graphs:
        runner.capture_cuda_graphs(opts.batch)
    return runner, pages


def decode_chunks(opts: argparse.Namespace, pages: int, adapters: int, distinct_tokens: bool = False):
    """One decode step of the batch, sequence b on adapter b % adapters (none when 0); with
    `distinct_tokens` every sequence feeds its own token (an MoE routes them to many experts)."""
    tables = [list(range(1 + b * pages, 1 + (b + 1) * pages)) for b in range(opts.batch)]
    slots = [b % adapters if adapters else -1 for b in range(opts.batch)]
    return [
        SeqChunk([7 + b if distinct_tokens else 7], opts.context - 1, t, s, True)
        for b, (t, s) in enumerate(zip(tables, slots, strict=True))
    ]


def bench_model(name: str, shape: dict, opts: argparse.Namespace, device: torch.device) -> dict:
    runner, pages = decode_runner(shape, opts, device, graphs=True)

    def chunks(adapters: int) -> list[SeqChunk]:
        return decode_chunks(opts, pages, adapters)

    base = step_ms(runner, chunks(0), opts.steps, device)
    lora = step_ms(runner, chunks(opts.adapters), opts.steps, device)
    row = dict(
        model=name,
        architecture=runner.config.architecture,
        batch=opts.batch,
        context=opts.context,
        adapters=opts.adapters,
        base_ms=base,
        adapters_ms=lora,
        adapters_vs_base=base / lora,
        weight_bytes=weight_bytes(runner),
        kv_bytes=kv_bytes(runner, opts.batch, opts.context),
    )
    if device.type == "cuda":
        row["floor_ms"] = (row["weight_bytes"] + row["kv_bytes"]) / opts.bandwidth * 1e3
        row["base_vs_floor"] = base / row["floor_ms"]
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def decode_parser(description: str, steps: int, tiny_help: str) -> argparse.ArgumentParser:
    """The flags of a decode-step bench over random runners (this one and bench/moe.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence (the decoded one included)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    add_out_argument(p)
    return p


def main() -> None:
    p = decode_parser(__doc__.split("\n")[0], 50, "tiny shapes of every family on the CPU (smoke run)")
    opts = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.tiny else "cpu")
    if opts.tiny:
        models = {f"tiny-{f}": {**TINY, **TINY_FAMILIES[f]} for f in ("qwen3", "gemma2", "gemma3", "phi3")}
        opts.batch, opts.context, opts.steps = min(opts.batch, 8), min(opts.context, 40), min(opts.steps, 5)
    else:
        models = FAMILY_SHAPES
        opts.bandwidth = copy_bandwidth(device)
        print(f"copy bandwidth {opts.bandwidth / 1e12:.2f} TB/s")
    rows = [bench_model(name, shape, opts, device) for name, shape in models.items()]
    head = ("base ms", "floor ms", "x floor", "adapt ms", "base/ad")
    print(f"{'model':<14}{'batch':>6}{'ctx':>6}" + "".join(f"{h:>9}" for h in head))
    for r in rows:
        floor = f"{r['floor_ms']:>9.2f}{r['base_vs_floor']:>9.2f}" if "floor_ms" in r else f"{'-':>9}{'-':>9}"
        print(
            f"{r['model']:<14}{r['batch']:>6}{r['context']:>6}{r['base_ms']:>9.2f}{floor}"
            f"{r['adapters_ms']:>9.2f}{r['adapters_vs_base']:>9.2f}"
        )
    write_json(opts.out, "families", dict(device=device.type, rows=rows))


if __name__ == "__main__":
    main()
