"""Decode step of a random Qwen3-30B-A3B shaped mixture-of-experts model: batch 64 against the memory
floor, and 8 distinct attention adapters against the base model.

    PYTHONPATH=protos python3 -m loraplex.bench.moe [--batch 64] [--adapters 8] [--context 1024] [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.moe --tiny      # CPU smoke run: tiny Qwen3-MoE and Mixtral
    PYTHONPATH=protos python3 -m loraplex.bench.moe --graphs [--moe-kernel both|grouped|torch]

The runner is bench/families.py's (random bf16 weights, `--adapters` random rank-16 adapters on
q/k/v/o resident, the Triton LoRA backend on CUDA), eager unless `--graphs`, which captures the
decode CUDA graphs as the engine does for MoE models (both experts' kernels capture at batch <= 64:
the torch one runs dense there, the grouped one never syncs the host). Two floors
are printed: the issue's (active parameters: attention, routers, `top_k` experts per layer, the lm_head; plus
K/V) and the one a batch really reads (the experts its tokens touch: at batch 64 x top-8 of 128
nearly all of them). Goals (issue 39): base step <= 1.5x the active floor, 8 adapters >= 0.85x base.
`--moe-kernel` picks the experts' kernel per row (models/moe.py's MOE_TORCH_ON_CUDA): torch (dense at decode
sizes) and/or kernels/moe_grouped.py's grouped GEMM; on CUDA bench/moe_step_check.py checks the
grouped step against the torch one and its graph replay against eager first (ok / FAIL; exit 1).
`--expert-adapters`: the adapters also carry LoRA on every expert (gate_up and down, ranks 16 and 8
in turn; bench/moe_expert_lora.py), checked first against the per-expert loop; graphs are then off
(as the engine runs expert LoRA), and the loop's step time is printed beside the grouped one. With
`--graphs` too, `--expert-lora-mode graphs` (lora/expert_lora_graph.py, no host read) is then timed
eagerly and under decode CUDA graphs, after its replay is checked against its eager step.
"""

from __future__ import annotations

import argparse
import sys

import torch

from loraplex.bench.families import (
    copy_bandwidth,
    decode_chunks,
    decode_parser,
    decode_runner,
    kv_bytes,
    step_ms,
    weight_bytes,
)
from loraplex.bench.moe_expert_lora import attach_expert_lora, check_expert_lora, time_graph_mode
from loraplex.bench.moe_step_check import KERNELS, check_step, use_moe_kernel
from loraplex.bench.random_runner import TINY, TINY_FAMILIES
from loraplex.bench.results import write_json
from loraplex.services.inference.engine.scheduler import SeqChunk

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    rope_theta=1000000.0,
)
TINY_MOE = {f"tiny-{f}": {**TINY, **TINY_FAMILIES[f]} for f in ("qwen3_moe", "mixtral")}


def expert_bytes(runner) -> tuple[int, int, int]:
    """(all experts' bytes, one expert's bytes per sparse layer, experts per layer)."""
    total = one = 0
    experts = 1
    for layer in runner.model.layers:
        if layer.moe is not None:
            size = sum(p.numel() * p.element_size() for p in (layer.moe.gate_up, layer.moe.down))
            total += size
            experts = layer.moe.num_experts
            one += size // experts
    return total, one, experts


def bench_model(name: str, shape: dict, opts: argparse.Namespace, device: torch.device) -> list[dict]:
    """One row per kernel of `opts.moe_kernel`, over one random model (checked first on CUDA)."""
    runner, pages = decode_runner(shape, opts, device, graphs=False)

    def chunks(adapters: int) -> list[SeqChunk]:
        return decode_chunks(opts, pages, adapters, distinct_tokens=True)

    kernels = KERNELS if opts.moe_kernel == "both" else (opts.moe_kernel,)
    if opts.expert_adapters:  # one row: expert LoRA runs its own experts' path (lora/expert_moe.py)
        kernels = kernels[-1:]
    if device.type == "cuda" and "grouped" in kernels and check_step(runner, chunks(0), device, opts.graphs):
        print(f"FAIL: {name}: the grouped experts' step is wrong; not timing")
        sys.exit(1)
    rows = []
    for kernel in kernels:
        use_moe_kernel(kernel)
        if device.type == "cuda" and opts.graphs:
            runner.capture_cuda_graphs(opts.batch)  # again: the captured kernels are this row's
        rows.append(dict(moe_kernel=kernel, **time_model(name, runner, chunks, opts, device)))
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def time_model(name: str, runner, chunks, opts: argparse.Namespace, device: torch.device) -> dict:
    base = step_ms(runner, chunks(0), opts.steps, device)
    extra = {}
    if opts.expert_adapters:
        attach_expert_lora(runner, opts.adapters)
        failures = check_expert_lora(runner, opts.adapters)
        for line in failures:
            print(line)
        if failures:
            raise SystemExit(1)
        experts = runner.lora_backend.experts
        experts.grouped = False
        extra["expert_loop_ms"] = step_ms(runner, chunks(opts.adapters), opts.steps, device)
        experts.grouped = experts.span = hasattr(torch.nn.functional, "grouped_mm")
        extra["expert_span_ms"] = step_ms(runner, chunks(opts.adapters), opts.steps, device)
        if not experts.span_active:  # too many (slot, expert) groups: that was the grouped path
            extra["expert_span_ms"] = None
        experts.span = False  # adapters_ms: the eager grouped mode (the CPU's default), per adapter
        extra["expert_lora"] = True
    lora = step_ms(runner, chunks(opts.adapters), opts.steps, device)
    if opts.expert_graphs and device.type == "cuda":
        graph_row, failures = time_graph_mode(runner, chunks, opts, device)
        if failures:
            raise SystemExit(1)
        extra.update(graph_row)
    cfg = runner.config
    all_experts, one_expert, experts = expert_bytes(runner)
    top_k = cfg.moe.top_k
    dense = weight_bytes(runner) - all_experts
    # expected distinct experts a layer's `batch * top_k` picks touch, routing uniformly at random
    touched = experts * (1 - (1 - top_k / experts) ** opts.batch)
    row = dict(
        model=name,
        architecture=cfg.architecture,
        cuda_graphs=bool(device.type == "cuda" and opts.graphs),
        batch=opts.batch,
        context=opts.context,
        adapters=opts.adapters,
        base_ms=base,
        adapters_ms=lora,
        adapters_vs_base=base / lora,
        active_weight_bytes=dense + top_k * one_expert,
        touched_weight_bytes=int(dense + touched * one_expert),
        kv_bytes=kv_bytes(runner, opts.batch, opts.context),
        **extra,
    )
    if device.type == "cuda":
        kv = row["kv_bytes"]
        row["active_floor_ms"] = (row["active_weight_bytes"] + kv) / opts.bandwidth * 1e3
        row["touched_floor_ms"] = (row["touched_weight_bytes"] + kv) / opts.bandwidth * 1e3
        row["base_vs_active_floor"] = base / row["active_floor_ms"]
        row["base_vs_touched_floor"] = base / row["touched_floor_ms"]
    return row


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    p = decode_parser(__doc__.split("\n")[0], 20, "tiny Qwen3-MoE and Mixtral on the CPU (smoke run)")
    p.add_argument("--graphs", action="store_true", help="capture the decode CUDA graphs (batch <= 64)")
    p.add_argument(
        "--moe-kernel",
        choices=("both", *KERNELS),
        default="both",
        help="the experts' kernel per row: torch, grouped (CUDA), or a row of each",
    )
    p.add_argument(
        "--expert-adapters", action="store_true", help="the adapters carry LoRA on every expert too"
    )
    opts = p.parse_args()
    # --expert-adapters: the rows run eagerly (the grouped expert LoRA reads the step's slots on the
    # host); with --graphs the graphs mode (no host read; CUDA's default) is then timed under decode
    # graphs too.
    opts.expert_graphs = opts.expert_adapters and opts.graphs
    if opts.expert_adapters:
        opts.graphs = False
    device = torch.device("cuda" if torch.cuda.is_available() and not opts.tiny else "cpu")
    if opts.tiny:
        models = TINY_MOE
        opts.batch, opts.context, opts.steps = min(opts.batch, 8), min(opts.context, 40), min(opts.steps, 5)
    else:
        models = {"qwen3-30b-a3b": QWEN3_30B_A3B}
        opts.bandwidth = copy_bandwidth(device)
        print(f"copy bandwidth {opts.bandwidth / 1e12:.2f} TB/s")
    if device.type != "cuda":
        opts.moe_kernel = "torch"  # the CPU runs the torch experts
    rows = [row for name, shape in models.items() for row in bench_model(name, shape, opts, device)]
    head = ("base ms", "act flr", "x act", "tch flr", "x tch", "adapt ms", "base/ad")
    print(f"{'model':<16}{'kernel':>8}{'batch':>6}{'ctx':>6}" + "".join(f"{h:>9}" for h in head))
    for r in rows:
        floors = "".join(
            f"{r[k]:>9.2f}" if k in r else f"{'-':>9}"
            for k in ("active_floor_ms", "base_vs_active_floor", "touched_floor_ms", "base_vs_touched_floor")
        )
        print(
            f"{r['model']:<16}{r['moe_kernel']:>8}{r['batch']:>6}{r['context']:>6}{r['base_ms']:>9.2f}{floors}"
            f"{r['adapters_ms']:>9.2f}{r['adapters_vs_base']:>9.2f}"
            + (
                f"  (expert LoRA grouped; span {_ms(r['expert_span_ms'])}, loop {r['expert_loop_ms']:.2f} ms)"
                if "expert_loop_ms" in r
                else ""
            )
        )
        if "graphs_mode_base_ms" in r:
            print(
                f"  --expert-lora-mode graphs: eager {r['graphs_mode_eager_ms']:.2f} ms; decode graphs: base "
                f"{r['graphs_mode_base_ms']:.2f} ms, adapters {r['graphs_mode_adapters_ms']:.2f} ms, "
                f"base/ad {r['graphs_mode_adapters_vs_base']:.2f}"
            )
    write_json(opts.out, "moe", dict(device=device.type, rows=rows))


if __name__ == "__main__":
    main()
