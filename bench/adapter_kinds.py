"""Decode step with the adapter kinds beyond plain LoRA (issue 56's GPU row): batch 64 over 8
adapters of which 2 DoRA and 2 with embedding and lm_head LoRA, against the same step over 8 plain
adapters, on a random-weight Llama-3.1-8B shape.

    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds [--batch 64] [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds --tiny   # CPU smoke run

Every adapter has random A/B of rank <= 16 on a module set of lora/backend_check.py; DoRA slots get
random per-row factors (what `dora.fill_factors` computes at load), the embedding/lm_head slots rank-16
A/B on both. Decode CUDA graphs are captured as the server captures them; a step holding a DoRA or
embedding/lm_head request runs eagerly (lora/dora.py), which is what this measures. Prints both step
times and their ratio (goal: mixed >= 0.95x plain, i.e. plain_ms / mixed_ms).
"""

from __future__ import annotations

import dataclasses

import torch

from loraplex.bench.families import decode_chunks, decode_parser, decode_runner, step_ms
from loraplex.bench.random_runner import TINY
from loraplex.bench.results import write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.services.inference.lora.adapter import AdapterWeights
from loraplex.services.inference.lora.backend_check import MODULE_SETS, random_adapter
from loraplex.services.inference.lora.embedding_lora import EMBED_PATH, HEAD_PATH, EmbeddingLoRA


def special_adapter(base: AdapterWeights, kind: str, vocab: int, hidden: int, seed: int) -> AdapterWeights:
    """`base` made DoRA (random factors near 1 per targeted row) or given embedding and lm_head LoRA."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(iter(base.lora_a.values())).dtype
    if kind == "dora":
        factors = {k: 1 + 0.1 * torch.rand(b.shape[0], generator=gen) for k, b in base.lora_b.items()}
        spec = dataclasses.replace(base.spec, use_dora=True)
        return dataclasses.replace(base, spec=spec, dora_factor=factors)
    r = 16

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    embedding = {
        EMBED_PATH: EmbeddingLoRA(rand(r, vocab), rand(hidden, r), 1.0),
        HEAD_PATH: EmbeddingLoRA(rand(r, hidden), rand(vocab, r), 1.0),
    }
    return dataclasses.replace(base, embedding=embedding)


def main() -> None:
    p = decode_parser(__doc__.split("\n")[0], 50, "the tiny shape on the CPU (smoke run)")
    opts = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.tiny else "cpu")
    shape = TINY if opts.tiny else LLAMA_8B
    if opts.tiny:
        opts.batch, opts.context, opts.steps = min(opts.batch, 8), min(opts.context, 40), min(opts.steps, 5)
    runner, pages = decode_runner(shape, opts, device, graphs=True)
    chunks = decode_chunks(opts, pages, opts.adapters)
    plain = step_ms(runner, chunks, opts.steps, device)
    pool = runner.lora_backend.pool
    cfg = runner.config
    dtype = pool.dtype
    for slot, kind in ((0, "dora"), (1, "dora"), (2, "vocab"), (3, "vocab")):
        modules = MODULE_SETS[slot % len(MODULE_SETS)]
        base = random_adapter(pool.shapes, modules, 16, slot, dtype)
        pool.upload(slot, special_adapter(base, kind, cfg.vocab_size, cfg.hidden_size, slot))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mixed = step_ms(runner, chunks, opts.steps, device)
    row = dict(
        batch=opts.batch,
        adapters=opts.adapters,
        context=opts.context,
        plain_ms=plain,
        mixed_ms=mixed,
        mixed_vs_plain=plain / mixed,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    print(
        f"{'batch':>6}{'adapters':>9}{'plain ms':>10}{'mixed ms':>10}{'ratio':>8}"
        "  (2 DoRA + 2 embedding/lm_head of the adapters)"
    )
    print(f"{opts.batch:>6}{opts.adapters:>9}{plain:>10.2f}{mixed:>10.2f}{plain / mixed:>8.2f}")
    write_json(opts.out, "adapter_kinds", row)


if __name__ == "__main__":
    main()
