"""Decode step with the adapter kinds beyond plain LoRA (issue 56's GPU row): batch 64 over 8
adapters of which 2 DoRA and 2 with embedding and lm_head LoRA, against the same step over 8 plain
adapters, on a random-weight Llama-3.1-8B shape.

    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds [--out DIR]
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

from loraplex.bench import harness as h
from loraplex.bench.results import add_out_argument, write_json
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


def measure(tiny: bool, device: torch.device, batch: int = 64, adapters: int = 8, repeats: int = 50) -> dict:
    """The plain and the mixed decode step on one runner (the mixed one after four of its adapters are
    re-uploaded as DoRA / embedding+lm_head adapters), side by side."""
    shape = h.model_shape(tiny)
    context = 40 if tiny else 1024
    if tiny:
        batch, repeats = min(batch, 8), min(repeats, 5)
    runner, pages = h.step_runner(shape, device, batch=batch, context=context, adapters=adapters)
    chunks = h.decode_chunks(batch, context, pages, adapters)
    plain = h.time_step(runner, chunks, repeats)
    pool = runner.lora_backend.pool
    cfg = runner.config
    for slot, kind in ((0, "dora"), (1, "dora"), (2, "vocab"), (3, "vocab")):
        modules = MODULE_SETS[slot % len(MODULE_SETS)]
        base = random_adapter(pool.shapes, modules, 16, slot, pool.dtype)
        pool.upload(slot, special_adapter(base, kind, cfg.vocab_size, cfg.hidden_size, slot))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mixed = h.time_step(runner, chunks, repeats)
    del runner
    h.free(device)
    return dict(
        batch=batch,
        adapters=adapters,
        context=context,
        plain_ms=plain,
        mixed_ms=mixed,
        mixed_vs_plain=plain / mixed,
    )


def main(argv: list[str] | None = None) -> int:
    p = h.suite_parser("adapter_kinds", __doc__.split("\n")[0])
    add_out_argument(p)
    o = p.parse_args(argv)
    device = h.pick_device(o.device)
    row = measure(o.tiny, device)
    h.print_table(
        ["batch", "adapters", "plain ms", "mixed ms", "plain / mixed"],
        [
            [
                row["batch"],
                row["adapters"],
                h.fmt(row["plain_ms"]),
                h.fmt(row["mixed_ms"]),
                h.fmt(row["mixed_vs_plain"]),
            ]
        ],
    )
    write_json(o.out, "adapter_kinds", dict(row, meta=h.meta(device, o.tiny)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
