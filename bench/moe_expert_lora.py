"""bench/moe.py's `--expert-adapters`: random LoRA on every expert of a bench runner's resident
adapters (lora/expert_lora.py), and the check that comes before any timing: the grouped computation
(`F.grouped_mm`) against the per-(adapter, expert) loop on a few tokens of one sparse layer.
"""

from __future__ import annotations

import torch

from loraplex.bench.families import step_ms
from loraplex.bench.moe_step_check import rel_err
from loraplex.services.inference.lora.expert_lora import ExpertLoRA, ExpertLoRAPool
from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
from loraplex.services.inference.lora.shapes import EXPERT_MODULES, shapes_of_model

# Ranks of the adapters' expert LoRA, in turn (mixed: each adapter runs at its own rank).
EXPERT_RANKS = (16, 8)


def attach_expert_lora(runner, slots: int, seed: int = 0, grouped: bool | None = None) -> ExpertLoRAPool:
    """Give slots 0..slots-1 of the runner's LoRA backend random expert LoRA on gate_up and down."""
    backend = runner.lora_backend
    pool = ExpertLoRAPool(
        shapes_of_model(runner.config),
        slots=slots,
        max_rank=max(EXPERT_RANKS),
        modules=EXPERT_MODULES,
        dtype=backend.pool.dtype,
        device=backend.pool.device,
    )
    gen = torch.Generator(device=pool.a[EXPERT_MODULES[0]].device).manual_seed(seed)
    for m in pool.modules:
        a, b = pool.a[m], pool.b[m]
        a.zero_()  # zeros past each rank, as ExpertLoRAPool.upload writes them (the span mode reads them)
        b.zero_()
        for s in range(slots):
            r = EXPERT_RANKS[s % len(EXPERT_RANKS)]
            d_in = a.shape[-1]
            a[:, s, :, :r].normal_(0, d_in**-0.5, generator=gen)
            b[:, s, :, :, :r].normal_(0, 0.1 * r**-0.5, generator=gen)
            pool.host_rank[m][:, s] = r
            pool.host_scaling[m][:, s] = 2.0
            pool.dev_scaling[m][:, s] = 2.0
    backend.experts = ExpertLoRA(pool, grouped=grouped)
    return pool


def check_expert_lora(runner, slots: int, tokens: int = 24) -> list[str]:
    """FAIL lines where the grouped computation and the loop disagree on one sparse layer."""
    backend = runner.lora_backend
    layer = next(i for i, lay in enumerate(runner.model.layers) if lay.moe is not None)
    moe = runner.model.layers[layer].moe
    device, dtype = backend.pool.device, backend.pool.dtype
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, moe.gate.shape[1], generator=gen, device=device).to(dtype)
    token_slots = torch.tensor([t % (slots + 1) - 1 for t in range(tokens)], dtype=torch.int32, device=device)
    outs = {}
    failures = []
    pool = backend.experts.pool
    with torch.no_grad():
        for grouped in ("span", True, False, "graphs"):
            lora = (
                GraphExpertLoRA(pool)
                if grouped == "graphs"
                else ExpertLoRA(pool, grouped=bool(grouped), span=grouped == "span")
            )
            lora.prepare(token_slots)
            for dense in (True, False):
                outs[(grouped, dense)] = lora.at(layer).moe_forward(moe, x, dense=dense).float()
            if device.type == "cuda":  # the deltas inside kernels/moe_grouped.py (the default there)
                hook = lora.at(layer)
                outs[(grouped, "kernel")] = hook.moe_forward(moe, x, dense=False, grouped=True).float()
        base = moe(x).float()
    ref = outs[(False, False)]
    scale = ref.abs().max().item()
    for key, out in outs.items():
        err = (out - ref).abs().max().item()
        if err > 2e-2 * scale:
            failures.append(
                f"FAIL expert LoRA mode={key[0]} base path={key[1]}: max error {err:.3g} vs the loop"
            )
    lora_rows = token_slots >= 0
    if (ref[lora_rows] - base[lora_rows]).abs().max().item() < 1e-3 * scale:
        failures.append("FAIL expert LoRA changes nothing")
    if (ref[~lora_rows] - base[~lora_rows]).abs().max().item() > 2e-2 * scale:
        failures.append("FAIL expert LoRA changes base tokens")
    return failures


def time_graph_mode(runner, chunks, opts, device) -> tuple[dict, list[str]]:
    """`--expert-lora-mode graphs` (lora/expert_lora_graph.py): its eager step, then decode CUDA graphs
    captured with it, base and adapter steps, after checking the replay against the eager step."""
    backend = runner.lora_backend
    backend.experts = GraphExpertLoRA(backend.experts.pool)
    adapters = chunks(opts.adapters)
    eager_ms = step_ms(runner, adapters, opts.steps, device)
    eager = runner.forward(adapters).clone()
    runner.capture_cuda_graphs(opts.batch)
    replay = runner.forward(adapters).clone()
    err = rel_err(replay, eager)
    failures = [] if err < 1e-2 else [f"FAIL expert LoRA graphs mode: graph replay vs eager {err:.3g}"]
    print(f"{'ok' if not failures else 'FAIL'}: expert LoRA graphs mode, replay vs eager: {err:.2e} (< 0.01)")
    if failures:
        return {}, failures
    row = dict(
        graphs_mode_eager_ms=eager_ms,
        graphs_mode_base_ms=step_ms(runner, chunks(0), opts.steps, device),
        graphs_mode_adapters_ms=step_ms(runner, adapters, opts.steps, device),
    )
    row["graphs_mode_adapters_vs_base"] = row["graphs_mode_base_ms"] / row["graphs_mode_adapters_ms"]
    return row, []
