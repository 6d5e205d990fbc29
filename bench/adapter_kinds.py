"""Decode step with the adapter kinds beyond plain LoRA (issue 56's GPU row): batch 64 over 8
adapters of which 2 DoRA and 2 with embedding and lm_head LoRA, against the same step over 8 plain
adapters, on a random-weight Llama-3.1-8B shape.

    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds --tiny   # CPU smoke run
    PYTHONPATH=protos python3 -m loraplex.bench.adapter_kinds --check [--tiny]   # graph == eager

Every adapter has random A/B of rank <= 16 on a module set of lora/backend_check.py; DoRA slots get
random per-row factors (what `dora.fill_factors` computes at load), the embedding/lm_head slots rank-16
A/B on both. Decode CUDA graphs are captured as the server captures them; the step holding DoRA and
embedding/lm_head requests replays the graphs' kinds variant (engine/cuda_graph.py), captured lazily
by its first step: that capture is timed apart (`kinds_capture_s`, `kinds_capture_mib`) and the timed
steps replay it; `kinds_tables_mib` is what the DoRA factor and vocab-slot tables took. On the CPU
(no graphs) both steps run eagerly. Prints both step times and their ratio (goal: mixed >= 0.95x
plain, i.e. plain_ms / mixed_ms).

`--check`: one decode step over base tokens, plain, DoRA, embedding+lm_head LoRA and trainable-token
adapters (embedding rows hit by the step's token ids), replayed from the kinds-variant graph and run
eagerly on the same runner: one line, exit 1 unless the logits agree (bf16 tolerance), the graph
was the variant, and each kind changes its own rows against the same step with the kinds off. On
the CPU it runs the eager step twice (a smoke run of the setup only).
"""

from __future__ import annotations

import dataclasses

import torch

from loraplex.bench import harness as h
from loraplex.bench.results import add_out_argument, write_json
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend_check import MODULE_SETS, random_adapter
from loraplex.services.inference.lora.embedding_lora import EMBED_PATH, HEAD_PATH, EmbeddingLoRA
from loraplex.services.inference.lora.trainable_tokens import TokenRows

# The check's tolerance: graph and eager logits differ only by the LoRA launch plan (a graph plans for
# its tier's bound, an eager step for its own adapters): bf16 rounding, relative to the logits' scale.
CHECK_REL_TOL = 2e-2


def special_adapter(base: AdapterWeights, kind: str, vocab: int, hidden: int, seed: int) -> AdapterWeights:
    """`base` made DoRA (random factors near 1 per targeted row), given embedding and lm_head LoRA
    ("vocab"), or trainable-token rows of the embedding and lm_head ("tokens": ids 5..12, with 7, the
    token `decode_chunks` feeds)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(iter(base.lora_a.values())).dtype
    if kind == "dora":
        factors = {k: 1 + 0.1 * torch.rand(b.shape[0], generator=gen) for k, b in base.lora_b.items()}
        spec = dataclasses.replace(base.spec, use_dora=True)
        return dataclasses.replace(base, spec=spec, dora_factor=factors)
    r = 16

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    if kind == "tokens":
        rows = TokenRows(torch.arange(5, 13), rand(8, hidden))
        return dataclasses.replace(base, token_rows={EMBED_PATH: rows, HEAD_PATH: rows})

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
    upload_kinds(runner, ((0, "dora"), (1, "dora"), (2, "vocab"), (3, "vocab")))
    runner.forward(chunks)  # the first such step captures the kinds-variant graph (timed apart)
    captures = [] if runner.cuda_graphs is None else runner.cuda_graphs.kinds_captures
    pool = runner.lora_backend.pool
    tables = (pool.vocab.nbytes + pool.dora.nbytes) / 2**20  # DoRA factors and vocab slots
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
        kinds_capture_s=sum(c[1] for c in captures) if captures else None,
        kinds_capture_mib=sum(c[2] for c in captures) / 2**20 if captures else None,
        kinds_tables_mib=tables,
    )


def upload_kinds(runner, kinds) -> None:
    """Upload (slot, kind) adapters of `special_adapter` over the runner's random plain ones."""
    pool, cfg = runner.lora_backend.pool, runner.config
    for slot, kind in kinds:
        modules = MODULE_SETS[slot % len(MODULE_SETS)]
        base = random_adapter(pool.shapes, modules, 16, slot, pool.dtype)
        pool.upload(slot, special_adapter(base, kind, cfg.vocab_size, cfg.hidden_size, slot))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def check(tiny: bool, device: torch.device, batch: int = 16, adapters: int = 8) -> tuple[bool, str]:
    """Graph replay vs the eager step on one runner (see the module docstring): (ok, one line)."""
    shape = h.model_shape(tiny)
    context = 40
    runner, pages = h.step_runner(shape, device, batch=batch, context=context, adapters=adapters)
    kinds = ((0, "dora"), (1, "dora"), (2, "vocab"), (3, "tokens"), (4, "vocab"))
    upload_kinds(runner, kinds)
    chunks = h.decode_chunks(batch, context, pages, adapters)
    for i in range(0, batch, 5):  # base-model tokens beside them
        chunks[i] = chunks[i]._replace(lora_slot=-1)
    graphs = runner.cuda_graphs
    got = runner.forward(chunks).clone()
    used = graphs is not None and any(k[2] for k in graphs.graphs)
    runner.cuda_graphs = None
    try:
        want = runner.forward(chunks).clone()
    finally:
        runner.cuda_graphs = graphs
    # the same step with the kinds' parts off (the plain graph): each kind must change its own rows,
    # else the comparison above would pass with the parts left out of both paths
    pool = runner.lora_backend.pool
    kinds_slots, pool.kinds_slots = pool.kinds_slots, frozenset()
    try:
        without = runner.forward(chunks).clone()
    finally:
        pool.kinds_slots = kinds_slots
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    worst = diff / max(scale, 1e-6)
    changed = {}
    for name, slots in (("DoRA", (0, 1)), ("LoRA", (2, 4)), ("tokens", (3,))):
        rows = [i for i, c in enumerate(chunks) if c.lora_slot in slots]
        moved = (got[rows] - without[rows]).abs().max().item()
        changed[name] = moved > max(10 * diff, 1e-3 * scale)
    ok = bool(torch.isfinite(got).all()) and worst <= CHECK_REL_TOL and (used or graphs is None)
    ok = ok and all(changed.values())
    mode = "kinds-variant graph vs eager" if graphs is not None else "eager twice (no CUDA graphs here)"
    line = (
        f"adapter_kinds check: {mode}, batch {batch} (base, plain, 2 DoRA, 2 embedding+lm_head LoRA, "
        f"trainable tokens): max |diff| / max |logit| = {worst:.2e} (tol {CHECK_REL_TOL:.0e}), "
        f"parts change their rows: {' '.join(f'{k}={v}' for k, v in changed.items())}, "
        f"variant replayed: {used} -> {'OK' if ok else 'MISMATCH'}"
    )
    return ok, line


def main(argv: list[str] | None = None) -> int:
    p = h.suite_parser("adapter_kinds", __doc__.split("\n")[0])
    add_out_argument(p)
    p.add_argument("--check", action="store_true", help="graph replay vs eager logits; exit 1 on a mismatch")
    o = p.parse_args(argv)
    device = h.pick_device(o.device)
    if o.check:
        ok, line = check(o.tiny, device)
        print(line, flush=True)
        return 0 if ok else 1
    row = measure(o.tiny, device)
    h.print_table(
        [
            "batch",
            "adapters",
            "plain ms",
            "mixed ms",
            "plain / mixed",
            "kinds capture s",
            "capture MiB",
            "tables MiB",
        ],
        [
            [
                row["batch"],
                row["adapters"],
                h.fmt(row["plain_ms"]),
                h.fmt(row["mixed_ms"]),
                h.fmt(row["mixed_vs_plain"]),
                h.fmt(row["kinds_capture_s"]),
                h.fmt(row["kinds_capture_mib"], ".0f"),
                h.fmt(row["kinds_tables_mib"], ".1f"),
            ]
        ],
    )
    write_json(o.out, "adapter_kinds", dict(row, meta=h.meta(device, o.tiny)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
