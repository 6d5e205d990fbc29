"""One mixture-of-experts layer's experts, per kernel: the torch dense path (every expert over every
token), the torch sorted path (host sync), and kernels/moe_grouped.py's Triton grouped GEMM, at
Qwen3-30B-A3B and Mixtral-8x7B layer shapes from decode to prefill sizes, against the layer's
floor (the experts the step's routing touches, read once, at the copy bandwidth); then a block-size
sweep of the grouped kernel within `--budget-s`. `align` / `align pt`: the sort and tile table
alone (kernels/moe_align.py's one launch, and its torch reference's ~25).

    PYTHONPATH=protos python3 -m loraplex.bench.moe_kernels [--budget-s 150] [--out DIR]

Correctness first: kernels/moe_grouped_check.py's CUDA cases (grouped vs its torch reference) and, per
shape, the grouped path against the dense and sorted torch paths of models/moe.py's SparseMoE,
eager and replayed from a CUDA graph (prints ok / FAIL; exits 1 on a failure). Graph-safe paths
(dense, grouped) are timed as CUDA-graph replays, the sorted path eagerly (it syncs the host).
The sweep prints the best config per (shape, tokens) and writes it in the JSON (`sweep`), to be
copied into `default_config` of kernels/moe_grouped.py when it wins.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial

import torch

from loraplex.bench.families import copy_bandwidth
from loraplex.bench.graph_timing import capture, graph_time_us
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.moe_align import moe_tiles_triton
from loraplex.kernels.moe_grouped import default_config, grouped_moe, max_tiles_for, moe_tiles
from loraplex.kernels.moe_grouped_check import CUDA_CASES, run_case
from loraplex.services.inference.models.config import MoEConfig
from loraplex.services.inference.models.moe import SparseMoE

SHAPES = {  # hidden, expert width, experts, top k, norm_topk_prob, Mixtral's float32 routing weights
    "qwen3-30b-a3b": (2048, 768, 128, 8, True, False),
    "mixtral-8x7b": (4096, 14336, 8, 2, True, True),
}
TOKENS = (1, 16, 64, 256, 2048)
DENSE_MAX = 256  # the dense path's [E, T, hidden] outputs grow with T: not timed beyond
SWEEP_TOKENS = (64, 2048)
SWEEP = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for m, n, k, w, s in itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8), (3, 4))
]


def make_block(name: str, device: torch.device) -> SparseMoE:
    hidden, inter, experts, top_k, norm, float_weights = SHAPES[name]
    with torch.device(device):  # allocated on the GPU, not copied there
        block = SparseMoE(hidden, MoEConfig(experts, top_k, inter, norm, (True,)), "silu", float_weights)
    block = block.to(torch.bfloat16)
    for p in (block.gate, block.gate_up, block.down):
        p.data.normal_(0, p.shape[-1] ** -0.5)
    return block


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check(device: torch.device) -> list[str]:
    """FAIL lines (empty: all ok)."""
    fails = []
    for i, case in enumerate(CUDA_CASES):
        r = run_case(*case, seed=i, device=device)
        ok = r["rel_err"] < 1e-2 and r["tiles_ok"] and r["shape_ok"]
        print(f"{'ok' if ok else 'FAIL'}: grouped vs reference {case[:5]} rel err {r['rel_err']:.2e}")
        fails += [] if ok else [str(r)]
    for name in SHAPES:
        block = make_block(name, device)
        for tokens in (1, 64, 300):
            x = torch.randn(tokens, block.gate.shape[1], device=device, dtype=torch.bfloat16)
            w, e = block.route(x)
            grouped = block._grouped(x, w, e)
            paths = {"sorted": block._sorted(x, w, e)}
            if tokens <= DENSE_MAX:
                paths["dense"] = block._dense(x, w, e)
            out = torch.empty_like(grouped)
            graph = capture(partial(_into, out, partial(block._grouped, x, w, e)))
            graph.replay()
            torch.cuda.synchronize()
            paths["grouped graph replay"] = out
            for path, ref in paths.items():
                err = rel_err(grouped, ref)
                ok = err < (1e-5 if "graph" in path else 1.5e-2)
                print(f"{'ok' if ok else 'FAIL'}: {name} T={tokens} grouped vs {path}: rel err {err:.2e}")
                fails += [] if ok else [f"{name} {tokens} {path} {err}"]
        del block
        torch.cuda.empty_cache()
    return fails


def _into(out: torch.Tensor, fn) -> None:
    out.copy_(fn())


def eager_us(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def touched_bytes(block: SparseMoE, experts: torch.Tensor) -> int:
    one = (block.gate_up[0].numel() + block.down[0].numel()) * block.down.element_size()
    return int(torch.unique(experts).numel()) * one


def layer_rows(device: torch.device, bandwidth: float) -> list[dict]:
    rows = []
    for name in SHAPES:
        block = make_block(name, device)
        hidden = block.gate.shape[1]
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            w, e = block.route(x)
            row = dict(shape=name, tokens=tokens, floor_us=touched_bytes(block, e) / bandwidth * 1e6)
            row["grouped_us"] = graph_time_us([partial(block._grouped, x, w, e)])
            row["sorted_us"] = eager_us(partial(block._sorted, x, w, e))
            if tokens <= DENSE_MAX:
                row["dense_us"] = graph_time_us([partial(block._dense, x, w, e)])
            # the sort + tile table alone: the one Triton launch the kernel uses vs its torch reference
            pairs, experts = e.numel(), block.num_experts
            bm = default_config(pairs, min(hidden, block.inter))["BLOCK_M"]
            tiles = max_tiles_for(pairs, experts, bm)
            row["align_us"] = graph_time_us([partial(moe_tiles_triton, e, experts, bm, tiles)])
            row["align_torch_us"] = graph_time_us([partial(moe_tiles, e, experts, bm)])
            rows.append(row)
        del block
        torch.cuda.empty_cache()
    return rows


def sweep(device: torch.device, deadline: float) -> list[dict]:
    """Per (shape, tokens): SWEEP configs' graph-replay times, each pair an equal share of the time left."""
    out = []
    todo = list(itertools.product(SHAPES, SWEEP_TOKENS))
    for i, (name, tokens) in enumerate(todo):
        share = time.perf_counter() + max(0.0, deadline - time.perf_counter()) / (len(todo) - i)
        block = make_block(name, device)
        x = torch.randn(tokens, block.gate.shape[1], device=device, dtype=torch.bfloat16)
        w, e = block.route(x)
        default = default_config(tokens * block.top_k, min(block.gate.shape[1], block.inter))
        ref = grouped_moe(x, block.gate_up, block.down, w, e)
        results = []
        for config in [default, *SWEEP]:
            if time.perf_counter() > share:
                break
            try:
                got = grouped_moe(x, block.gate_up, block.down, w, e, config=config)
                if rel_err(got, ref) > 1e-2:
                    print(f"FAIL: {name} T={tokens} {config} differs from the default config")
                    continue
                us = graph_time_us([partial(grouped_moe, x, block.gate_up, block.down, w, e, config=config)])
            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run (shared memory): skipped
                print(f"skip {config}: {type(exc).__name__}")
                continue
            results.append(dict(config=config, us=us))
        if results:
            best = min(results, key=lambda r: r["us"])
            out.append(
                dict(shape=name, tokens=tokens, default_us=results[0]["us"], best=best, tried=len(results))
            )
        del block
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--budget-s", type=float, default=150.0, help="stop the sweep after this many seconds in all"
    )
    add_out_argument(p)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the CPU checks are tests/integration/test_moe_grouped.py)")
        return 0
    start = time.perf_counter()
    device = torch.device("cuda")
    fails = check(device)
    if fails:
        print(f"FAIL: {len(fails)} correctness checks failed; not timing")
        return 1
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = layer_rows(device, bandwidth)
    head = ("floor us", "dense", "sorted", "grouped", "x floor", "align", "align pt")
    print(f"{'shape':<16}{'tokens':>7}" + "".join(f"{h:>10}" for h in head))
    for r in rows:
        dense = f"{r['dense_us']:>10.1f}" if "dense_us" in r else f"{'-':>10}"
        print(
            f"{r['shape']:<16}{r['tokens']:>7}{r['floor_us']:>10.1f}{dense}{r['sorted_us']:>10.1f}"
            f"{r['grouped_us']:>10.1f}{r['grouped_us'] / r['floor_us']:>10.2f}"
            f"{r['align_us']:>10.1f}{r['align_torch_us']:>10.1f}"
        )
    swept = sweep(device, start + opts.budget_s)
    print(f"{'shape':<16}{'tokens':>7}{'default us':>12}{'best us':>10}  best config (of tried)")
    for s in swept:
        best = s["best"]
        times = f"{s['default_us']:>12.1f}{best['us']:>10.1f}"
        print(f"{s['shape']:<16}{s['tokens']:>7}{times}  {best['config']} ({s['tried']})")
    write_json(opts.out, "moe_kernels", dict(bandwidth=bandwidth, layers=rows, sweep=swept))
    return 0


if __name__ == "__main__":
    sys.exit(main())
