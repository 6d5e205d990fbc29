"""Pieces of bench/lora_fused.py: one Llama-3.1-8B layer's LoRA groups run fused or as the current
two launches per group, over the copies of bench/lora_layer.py, and the budgeted block-size sweep of
the fused kernel (CUDA-graph replays)."""

from __future__ import annotations

import time

import torch
import triton

from loraplex.bench.graph_timing import graph_time_us
from loraplex.bench.lora_layer import DEVICE, GROUPS, floor_of
from loraplex.kernels.lora_configs import FusedConfig, family, fused_default_config
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_fused import lora_fused, lora_fused_ref
from loraplex.kernels.lora_plan import GroupLaunch, GroupShape, many_adapters, plan_group
from loraplex.kernels.lora_shrink import lora_shrink

H200_COPY_BW = 4.25e12  # bytes/s (read + write) of a device-to-device copy on an H200


def fused_key(sc: dict, group: str) -> str:
    """The group's FUSED_TABLE key, in the JSON form `load_overrides` reads."""
    d, widths = GROUPS[group]
    many = not sc["prefill"] and many_adapters(sc["distinct"])
    fam = "decode_many" if many and family(sc["tokens"]) == "decode" else family(sc["tokens"])
    return f"{fam}|{d}|{sum(widths)}|{len(widths)}|{sc['rank']}"


def group_launch(sc: dict, group: str) -> GroupLaunch:
    """The two-kernel launch the engine's plan makes for this group (its tables, its tier)."""
    d, widths = GROUPS[group]
    many = not sc["prefill"] and many_adapters(sc["distinct"])
    return plan_group(GroupShape(d, widths, sc["rank"]), sc["tokens"], sc["distinct"], many)


def floor_bytes(sc: dict, group: str) -> float:
    """A and B bytes of the step's adapters + x read + out read and written (bf16; in delta mode
    the float32 write moves as many bytes): lora_layer's shrink + expand bytes less the rank-r
    intermediate, which the fused kernel keeps on chip."""
    n, T, r = len(GROUPS[group][1]), sc["tokens"], sc["rank"]
    both = floor_of(sc, group, "shrink", 1.0, 1.0)[1] + floor_of(sc, group, "expand", 1.0, 1.0)[1]
    return both - 2 * 2 * T * n * r


def add_delta_buffers(copies: list[dict], sc: dict) -> None:
    for c in copies:
        for g, (_, widths) in GROUPS.items():
            c[g]["delta"] = torch.zeros(sc["tokens"], sum(widths), device=DEVICE, dtype=torch.float32)


def two_kernel_fn(c: dict, group: str, segs, launch: GroupLaunch, y: torch.Tensor, delta: bool):
    p, widths = c[group], GROUPS[group][1]
    out = p["delta"] if delta else p["out"]

    def run() -> None:
        lora_shrink(p["x"], p["A"], p["ranks"], segs, y, launch)
        lora_expand(y, p["B"], p["ranks"], p["scal"], segs, out, widths, launch, accumulate=not delta)

    return run


def fused_fn(c: dict, group: str, segs, launch: GroupLaunch, delta: bool):
    p, widths = c[group], GROUPS[group][1]
    out = p["delta"] if delta else p["out"]
    return lambda: lora_fused(
        p["x"], p["A"], p["B"], p["ranks"], p["scal"], segs, out, widths, launch, accumulate=not delta
    )


def shrink_buffers(sc: dict) -> dict[str, torch.Tensor]:
    out = {}
    for g, (_, widths) in GROUPS.items():
        splits = group_launch(sc, g).splits
        out[g] = torch.zeros(splits, sc["tokens"], len(widths) * sc["rank"], device=DEVICE)
    return out


def check_fused(c: dict, sc: dict, group: str, segs, cfg: FusedConfig) -> float:
    """Worst relative error of the fused delta vs the torch reference, both modes (bf16)."""
    p, widths = c[group], GROUPS[group][1]
    launch = group_launch(sc, group)._replace(fused=cfg)
    worst = 0.0
    for delta in (False, True):
        base = torch.zeros_like(p["delta"]) if delta else p["out"]
        got, want = base.clone(), base.clone()
        args = (p["x"], p["A"], p["B"], p["ranks"], p["scal"], segs)
        lora_fused(*args, got, widths, launch, accumulate=not delta)
        lora_fused_ref(*args, want, widths, accumulate=not delta)
        d_got, d_want = got.float() - base.float(), want.float() - base.float()
        err = ((d_got - d_want).norm() / d_want.norm()).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst


def candidates(sc: dict) -> list[FusedConfig]:
    """The default first, then compiled variants (block sizes, warps, stages) each over several chunk
    widths (a runtime argument: no new compile), so a short budget still sees varied chunks. Decode
    variants lead with deep K tiles: few programs stream each adapter's A, so the bytes each keeps in
    flight bound the bandwidth."""
    if family(sc["tokens"]) == "decode":
        variants = [
            (16, 256, 128, 4, 3),
            (16, 512, 128, 8, 3),
            (16, 1024, 128, 8, 2),
            (16, 256, 256, 8, 4),
            (16, 128, 64, 4, 3),
        ]
        chunks = (16384, 4096, 2048, 1024, 512)
    else:
        variants = [(64, 64, 128, 8, 3), (64, 64, 128, 4, 3), (128, 64, 128, 8, 3), (64, 32, 256, 8, 3)]
        chunks = (16384, 4096, 2048)
    out = [fused_default_config(sc["tokens"])]
    for bm, bk, bn, nw, ns in variants:
        out += [FusedConfig(bm, bk, bn, ch, nw, ns) for ch in chunks if ch >= bn]
    return list(dict.fromkeys(out))


def time_or_inf(fns: list) -> float:
    try:
        return graph_time_us(fns, replays=10)
    except triton.runtime.errors.OutOfResources:  # too big for shared memory or registers: skip
        return float("inf")


def sweep_group(
    sc: dict, group: str, copies: list[dict], segs, delta: bool, budget_s: float
) -> tuple[FusedConfig, float, list[dict]]:
    """Time fused candidates for one group until `budget_s` runs out; (best, its us, rows)."""
    deadline = time.monotonic() + budget_s
    base = group_launch(sc, group)
    rows, best = [], (float("inf"), fused_default_config(sc["tokens"]))
    for cfg in candidates(sc):
        if rows and time.monotonic() > deadline:
            break
        launch = base._replace(fused=cfg)
        us = time_or_inf([fused_fn(c, group, segs, launch, delta) for c in copies])
        rows.append(dict(scenario=sc["name"], group=group, delta=delta, config=cfg._asdict(), graph_us=us))
        best = min(best, (us, cfg), key=lambda t: t[0])
    return best[1], best[0], rows
