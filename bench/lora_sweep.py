"""Block-size sweeps for `python -m loraplex.bench.kernels --tune-lora` (`joint_sweep`): time candidate
configurations with CUDA-graph replays and return the best, plus every timed row."""

from __future__ import annotations

import torch
import triton

from loraplex.bench.graph_timing import graph_time_us
from loraplex.bench.lora_layer import DEVICE, GROUPS, floor_of, launch_of, make_copies, token_slots
from loraplex.kernels.lora_configs import (
    ExpandConfig,
    ShrinkConfig,
    expand_config,
    family,
    shrink_config,
    shrink_splits,
    splits_bucket,
)
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.lora_shrink import lora_shrink


def sweep_variants(sc: dict, group: str) -> tuple[list[tuple[ShrinkConfig, int]], list[ExpandConfig]]:
    """The table's entry first, then a few alternatives; K-splits stay the table's (keyed on d only)."""
    d, widths = GROUPS[group]
    n, r, T = len(widths), sc["rank"], sc["tokens"]
    S = shrink_splits(d, T)
    base_s, base_e = shrink_config(d, n, r, T), expand_config(sum(widths), n, r, T)
    br = base_s.block_r
    if family(T) == "decode":
        s_vars = [
            ShrinkConfig(16, br, 512, 4, 3),
            ShrinkConfig(16, br, 256, 8, 3),
            ShrinkConfig(16, br, 128, 4, 4),
        ]
        e_vars = [
            ExpandConfig(16, bn, ch, nw, 3)
            for bn in (256, 512, 1024)
            for ch in (1024, 2048, 4096)
            for nw in (4, 8)
            if ch >= bn
        ]
    else:
        s_vars = [
            ShrinkConfig(64, br, 128, 8, 3),
            ShrinkConfig(32, br, 128, 4, 3),
            ShrinkConfig(64, br, 64, 4, 3),
        ]
        e_vars = [
            ExpandConfig(bm, bn, ch, nw, 3)
            for (bm, bn, nw) in ((32, 256, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8))
            for ch in (512, 1024, 2048)
        ]
    s_all = [base_s] + [v for v in s_vars if v != base_s]
    return [(v, S) for v in s_all], [base_e] + [v for v in e_vars if v != base_e]


def _time_or_inf(fns: list) -> float:
    try:
        return graph_time_us(fns, replays=10)
    except triton.runtime.errors.OutOfResources:  # a variant too big for shared memory: skip it
        return float("inf")


def sweep(sc: dict) -> tuple[dict, list[dict]]:
    """Time block-size variants per group (graph replays); returns the best per group and all rows."""
    T, r = sc["tokens"], sc["rank"]
    per_copy = sum(floor_of(sc, g, k, 1.0, 1.0)[1] for g in GROUPS for k in ("shrink", "expand"))
    copies = make_copies(sc, per_copy)
    segs = build_segments(token_slots(sc), alloc_segments(T, sc["distinct"], DEVICE))
    best: dict = {}
    swept_e: dict = {}
    rows = []
    for g, (_, widths) in GROUPS.items():
        s_vars, e_vars = sweep_variants(sc, g)
        timed_s = []
        for cfg, S in s_vars:
            y = torch.zeros(S, T, len(widths) * r, device=DEVICE, dtype=torch.float32)
            launch = launch_of(sc, cfg, S, e_vars[0])
            fns = [
                (
                    lambda c=c[g], y=y, launch=launch: lora_shrink(
                        c["x"], c["A"], c["ranks"], c["pages"], segs, y, launch
                    )
                )
                for c in copies
            ]
            timed_s.append((_time_or_inf(fns), cfg, S))
            rows.append(
                dict(
                    scenario=sc["name"],
                    group=g,
                    kernel="shrink",
                    config=cfg._asdict(),
                    splits=S,
                    graph_us=timed_s[-1][0],
                )
            )
        us_s, cfg_s, S_best = min(timed_s, key=lambda t: t[0])
        y = torch.zeros(S_best, T, len(widths) * r, device=DEVICE, dtype=torch.float32)
        launch = launch_of(sc, cfg_s, S_best, e_vars[0])
        lora_shrink(
            copies[0][g]["x"],
            copies[0][g]["A"],
            copies[0][g]["ranks"],
            copies[0][g]["pages"],
            segs,
            y,
            launch,
        )
        timed_e = []
        e_key = (sum(widths), len(widths))  # o and down share one EXPAND_TABLE entry: sweep it once
        if e_key in swept_e:
            e_vars = [swept_e[e_key]]
        for cfg in e_vars:
            fns = [
                (
                    lambda c=c[g], launch=launch._replace(expand=cfg), w=widths, y=y: lora_expand(
                        y, c["B"], c["ranks"], c["scal"], c["pages"], segs, c["out"], w, launch
                    )
                )
                for c in copies
            ]
            timed_e.append((_time_or_inf(fns), cfg))
            rows.append(
                dict(
                    scenario=sc["name"],
                    group=g,
                    kernel="expand",
                    config=cfg._asdict(),
                    splits=S_best,
                    graph_us=timed_e[-1][0],
                )
            )
        us_e, cfg_e = min(timed_e, key=lambda t: t[0])
        swept_e[e_key] = cfg_e
        best[g] = (cfg_s, S_best, cfg_e)
        print(
            f"  sweep {sc['name']} {g}: shrink {cfg_s} S={S_best} {us_s:.1f}us (table {timed_s[0][0]:.1f})"
            f" | expand {cfg_e} {us_e:.1f}us (table {timed_e[0][0]:.1f})",
            flush=True,
        )
    del copies
    torch.cuda.empty_cache()
    return best, rows


def joint_sweep(scs: list[dict]) -> tuple[dict, list[dict]]:
    """K-splits and block sizes for several decode scenarios of one batch size at once.

    The engine captures one graph per batch size, whatever the step's adapter mix, so one
    configuration must serve few and many distinct adapters: minimise, per group, the sum over
    the scenarios of time / time with the current table. K-splits are chosen per input width
    `d` (the groups with that `d` share one shrink buffer). Returns the override JSON
    (`loraplex.kernels.lora_configs.load_overrides` format) and every timed row."""
    T, r = scs[0]["tokens"], scs[0]["rank"]
    fam = family(T)
    setups = []
    for sc in scs:
        per_copy = sum(floor_of(sc, g, k, 1.0, 1.0)[1] for g in GROUPS for k in ("shrink", "expand"))
        copies = make_copies(sc, per_copy)
        setups.append(
            (sc, copies, build_segments(token_slots(sc), alloc_segments(T, sc["distinct"], DEVICE)))
        )
    rows: list[dict] = []

    def shrink_times(g: str, cfg: ShrinkConfig, S: int) -> list[float]:
        widths = GROUPS[g][1]
        y = torch.zeros(S, T, len(widths) * r, device=DEVICE, dtype=torch.float32)
        out = []
        for sc, copies, segs in setups:
            launch = launch_of(sc, cfg, S, expand_config(sum(widths), len(widths), r, T))
            fns = [
                (
                    lambda c=c[g], launch=launch, segs=segs: lora_shrink(
                        c["x"], c["A"], c["ranks"], c["pages"], segs, y, launch
                    )
                )
                for c in copies
            ]
            out.append(_time_or_inf(fns))
            rows.append(
                dict(
                    scenario=sc["name"],
                    group=g,
                    kernel="shrink",
                    config=cfg._asdict(),
                    splits=S,
                    graph_us=out[-1],
                )
            )
        return out

    def expand_times(g: str, cfg: ExpandConfig, S: int) -> list[float]:
        widths = GROUPS[g][1]
        y = torch.zeros(S, T, len(widths) * r, device=DEVICE, dtype=torch.float32)
        out = []
        for sc, copies, segs in setups:
            launch = launch_of(sc, shrink_config(GROUPS[g][0], len(widths), r, T), S, cfg)
            fns = [
                (
                    lambda c=c[g], launch=launch, segs=segs: lora_expand(
                        y, c["B"], c["ranks"], c["scal"], c["pages"], segs, c["out"], widths, launch
                    )
                )
                for c in copies
            ]
            out.append(_time_or_inf(fns))
            rows.append(
                dict(
                    scenario=sc["name"],
                    group=g,
                    kernel="expand",
                    config=cfg._asdict(),
                    splits=S,
                    graph_us=out[-1],
                )
            )
        return out

    def score(times: list[float], base: list[float]) -> float:
        return sum(t / b for t, b in zip(times, base, strict=True))

    result: dict = {"splits": {}, "shrink": {}, "expand": {}}
    by_d: dict[int, list[str]] = {}
    for g, (d, _) in GROUPS.items():
        by_d.setdefault(d, []).append(g)
    chosen_s: dict[str, int] = {}
    for d, groups in by_d.items():
        table_s = shrink_splits(d, T)
        base = {g: shrink_times(g, shrink_config(d, len(GROUPS[g][1]), r, T), table_s) for g in groups}
        best_total, best = float("inf"), None
        for S in sorted({table_s, *((4, 8, 16) if d <= 8192 else (7, 14, 28))}):
            picks, total = {}, 0.0
            for g in groups:
                br = shrink_config(d, len(GROUPS[g][1]), r, T).block_r
                cands = [ShrinkConfig(16, br, bk, nw, 3) for bk in (64, 128, 256) for nw in (2, 4)]
                scored = [(score(shrink_times(g, c, S), base[g]), c) for c in cands]
                sc_best, cfg = min(scored, key=lambda t: t[0])
                picks[g], total = cfg, total + sc_best
            if total < best_total:
                best_total, best = total, (S, picks)
        S, picks = best
        result["splits"][f"{splits_bucket(T)}|{d}"] = S
        for g, cfg in picks.items():
            chosen_s[g] = S
            c = cfg
            result["shrink"][f"{fam}|{d}|{len(GROUPS[g][1])}|{r}"] = [
                c.block_m,
                c.block_r,
                c.block_k,
                c.num_warps,
                c.num_stages,
            ]
    for g, (_, widths) in GROUPS.items():
        key = f"{fam}|{sum(widths)}|{len(widths)}|{r}"
        if key in result["expand"]:  # o and down share an entry
            continue
        base = expand_times(g, expand_config(sum(widths), len(widths), r, T), chosen_s[g])
        cands = [
            ExpandConfig(16, bn, ch, nw, 3)
            for bn in (64, 128, 256)
            for ch in (128, 256, 512, 1024)
            for nw in (2, 4)
            if ch >= bn
        ]
        _, c = min(((score(expand_times(g, c, chosen_s[g]), base), c) for c in cands), key=lambda t: t[0])
        result["expand"][key] = [c.block_m, c.block_n, c.chunk_n, c.num_warps, c.num_stages]
    setups.clear()
    torch.cuda.empty_cache()
    return result, rows


def table_entries(sc: dict, best: dict) -> list[str]:
    """Lines to paste into kernels/lora_configs.py (SHRINK_TABLE / EXPAND_TABLE) for this (family, rank)."""
    fam, r = family(sc["tokens"]), sc["rank"]
    lines = []
    for g, (s_cfg, _, e_cfg) in best.items():
        d, widths = GROUPS[g]
        c = s_cfg
        lines.append(
            f"SHRINK ({fam!r}, {d}, {len(widths)}, {r}): "
            f"S({c.block_m}, {c.block_r}, {c.block_k}, {c.num_warps}, {c.num_stages}),  # {g}"
        )
        c = e_cfg
        lines.append(
            f"EXPAND ({fam!r}, {sum(widths)}, {len(widths)}, {r}): "
            f"E({c.block_m}, {c.block_n}, {c.chunk_n}, {c.num_warps}, {c.num_stages}),  # {g}"
        )
    return lines
