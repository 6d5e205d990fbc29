"""Randomized checks of kernels/moe_grouped.py against its torch reference; one JSON line per case.

    TRITON_INTERPRET=1 PYTHONPATH=protos python -m loraplex.kernels.moe_grouped_check   # CPU
    PYTHONPATH=protos python -m loraplex.kernels.moe_grouped_check --device cuda

Routing is deliberately uneven: a skewed expert distribution, experts that get no token at all,
one expert that takes most pairs (several tiles), a single token, and tile boundaries crossed.
Used by tests/integration/test_moe_grouped.py (interpreter, child process) and bench/moe_kernels.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from loraplex.kernels.moe_align import moe_tiles_triton
from loraplex.kernels.moe_grouped import grouped_moe, grouped_moe_ref, max_tiles_for, moe_tiles


def skewed_routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device) -> tuple:
    """(weights, experts) `[T, k]`: distinct experts per token, drawn from a skewed distribution
    over the first `num_experts - 2` experts (the last two never picked)."""
    used = max(top_k, num_experts - 2)
    popularity = torch.rand(used, generator=gen) ** 3 + 1e-3
    popularity[0] += 2.0  # one hot expert: several tiles
    experts = torch.multinomial(popularity.expand(tokens, used), top_k, replacement=False, generator=gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights.to(device), experts.to(device)


def check_tiles(experts: torch.Tensor, num_experts: int, block_m: int) -> bool:
    """Every pair lies in exactly one tile of its own expert (torch table), and the Triton table
    equals the torch one (the order exactly; the tiles in use)."""
    order, tile_expert, tile_row, tile_end = (t.cpu() for t in moe_tiles(experts, num_experts, block_m))
    flat = experts.flatten().cpu()
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    max_tiles = max_tiles_for(flat.numel(), num_experts, block_m)
    assert tile_expert.numel() == max_tiles
    got = [t.cpu() for t in moe_tiles_triton(experts, num_experts, block_m, max_tiles)]
    used = tile_expert < num_experts
    if not torch.equal(got[0], order) or not torch.equal(got[1], tile_expert):
        return False
    if not (torch.equal(got[2][used], tile_row[used]) and torch.equal(got[3][used], tile_end[used])):
        return False
    for e, r0, r1 in zip(tile_expert.tolist(), tile_row.tolist(), tile_end.tolist(), strict=True):
        if e >= num_experts:
            continue
        rows = order[r0 : min(r0 + block_m, r1)].long()
        if not bool((flat[rows] == e).all()):
            return False
        seen[rows] += 1
    return bool((seen == 1).all())


def run_case(
    tokens, hidden, inter, num_experts, top_k, dtype, activation, weights_fp32, seed, device
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    weights, experts = skewed_routing(tokens, num_experts, top_k, gen, device)
    weights = weights if weights_fp32 else weights.to(dtype)
    got = grouped_moe(x, gate_up, down, weights, experts, activation)
    ref = grouped_moe_ref(x, gate_up, down, weights, experts, activation)
    err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    return dict(
        tokens=tokens,
        hidden=hidden,
        inter=inter,
        experts=num_experts,
        top_k=top_k,
        dtype=str(dtype).removeprefix("torch."),
        activation=activation,
        rel_err=err,
        tiles_ok=check_tiles(experts, num_experts, 16) and check_tiles(experts, num_experts, 4),
        shape_ok=tuple(got.shape) == (tokens, hidden) and got.dtype == dtype,
    )


CPU_CASES = [  # (tokens, hidden, inter, experts, top_k, dtype, activation, float32 weights)
    (1, 32, 16, 8, 2, torch.float32, "silu", True),
    (7, 32, 48, 8, 2, torch.float32, "silu", False),
    (40, 64, 32, 8, 2, torch.float32, "gelu", True),
    (24, 32, 16, 8, 2, torch.float16, "silu", False),
]
CUDA_CASES = [
    (1, 2048, 768, 128, 8, torch.bfloat16, "silu", False),
    (64, 2048, 768, 128, 8, torch.bfloat16, "silu", False),
    (300, 2048, 768, 128, 8, torch.bfloat16, "silu", True),
    (2048, 4096, 1792, 8, 2, torch.bfloat16, "silu", True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    device = torch.device(opts.device)
    cases = CUDA_CASES if device.type == "cuda" else CPU_CASES
    for i, case in enumerate(cases):
        print(json.dumps(run_case(*case, seed=opts.seed + i, device=device)), flush=True)


if __name__ == "__main__":
    main()
