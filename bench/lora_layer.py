"""One Llama-3.1-8B decoder layer's LoRA work, for the kernel benchmarks (bench/lora_kernels.py and
its sweeps, bench/lora_sweep.py): the layer's groups of projections, a scenario's token slots and
inputs, and the floor of each kernel.

A scenario is a dict: name, tokens (T), distinct (adapters), rank, prefill (8 contiguous
segments) or decode (requests in arbitrary order).
"""

from __future__ import annotations

import torch

from loraplex.kernels.lora_configs import ExpandConfig, ShrinkConfig
from loraplex.kernels.lora_plan import GroupLaunch
from loraplex.services.inference.lora.pool_layout import page_rows, pages_for_rank

# group -> (input width d, stacked output widths): Llama-3.1-8B, GQA k/v = 8 heads x 128.
GROUPS: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
L2_BYTES = 50 * 2**20
DT = torch.bfloat16
DEVICE = "cuda"


def token_slots(sc: dict) -> torch.Tensor:
    T, a = sc["tokens"], sc["distinct"]
    if sc["prefill"]:  # 8 contiguous segments of 512 tokens
        return torch.arange(T, dtype=torch.int32).div(T // a, rounding_mode="floor").to(DEVICE)
    slots = torch.arange(T, dtype=torch.int32) % a  # decode: requests in arbitrary order
    return slots[torch.randperm(T)].to(DEVICE)


def floor_of(sc: dict, group: str, kernel: str, bw: float, rate: float) -> tuple[float, float, float]:
    """(floor seconds, bytes, flops) for one kernel of one group."""
    T, a, r = sc["tokens"], sc["distinct"], sc["rank"]
    d, widths = GROUPS[group]
    n, w = len(widths), sum(widths)
    if kernel == "shrink":
        nbytes = 2 * (a * n * r * d + T * d + T * n * r)
        flops = 2 * T * n * r * d
    else:
        nbytes = 2 * (a * w * r + T * n * r + 2 * T * w)
        flops = 2 * T * r * w
    return max(nbytes / bw, flops / rate), nbytes, flops


def make_copies(sc: dict, bytes_per_copy: float) -> list[dict]:
    copies = max(2, min(64, int(4 * L2_BYTES / bytes_per_copy) + 1))
    a, r, T = sc["distinct"], sc["rank"], sc["tokens"]
    P, pp = page_rows(r), pages_for_rank(r, r)
    out = []
    for _ in range(copies):
        c = {}
        # The pool's paged layout (services/inference/lora/pool.py), each adapter's pages scattered.
        pages = torch.randperm(a * pp, device=DEVICE).view(a, pp).to(torch.int32)
        for g, (d, widths) in GROUPS.items():
            n = len(widths)
            c[g] = dict(
                x=torch.randn(T, d, device=DEVICE, dtype=DT),
                A=(torch.randn(a * pp, n * P, d, device=DEVICE) * d**-0.5).to(DT),
                B=(torch.randn(a * pp, P, sum(widths), device=DEVICE) * r**-0.5).to(DT),
                pages=pages,
                ranks=torch.full((a, n), r, dtype=torch.int32, device=DEVICE),
                scal=torch.full((a, n), 2.0, dtype=torch.float32, device=DEVICE),
                out=torch.randn(T, sum(widths), device=DEVICE, dtype=DT),
            )
        out.append(c)
    return out


def launch_of(sc: dict, shrink: ShrinkConfig, splits: int, expand: ExpandConfig) -> GroupLaunch:
    """A group's launch over the scenario's distinct adapters (the pool of the copies holds just those)."""
    return GroupLaunch(splits=splits, shrink=shrink, expand=expand, distinct_bound=sc["distinct"])
