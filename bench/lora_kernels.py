"""GPU benchmark: Triton LoRA shrink/expand on Llama-3.1-8B shapes against their floor.

    PYTHONPATH=protos python3 -m loraplex.bench.lora_kernels [--sweep | --joint-sweep] [--quick] [--out DIR]

(the sweeps: bench/lora_sweep.py; the layer's shapes and inputs: bench/lora_layer.py).

Per scenario (decode batches 1/16/64/256 over 1/8/64 distinct adapters, prefill 8x512
over 8 adapters; ranks 16 and 64) and per kernel and one decoder layer's LoRA work
(qkv, o, gate_up, down; shrink + expand): the floor = max(bytes that must move / copy
bandwidth, FLOPs / bf16 matmul rate), both ceilings measured in this run; the median time
through `triton.testing.do_bench` and as replays of one captured CUDA graph that runs
the work over C copies of all inputs and adapter weights (C*bytes > 4x the 50 MB L2), time
per copy; and a plain torch loop over segments. bf16 kernel output is checked against the
torch reference before timing. Prints a table, writes lora_kernels.json to --out DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.testing

from loraplex.bench.graph_timing import graph_time_us
from loraplex.bench.lora_layer import DEVICE, DT, GROUPS, floor_of, launch_of, make_copies, token_slots
from loraplex.bench.lora_sweep import joint_sweep, sweep, table_entries
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.lora_check import CASES, run_case
from loraplex.kernels.lora_configs import (
    ExpandConfig,
    ShrinkConfig,
    expand_config,
    family,
    load_overrides,
    shrink_config,
    shrink_splits,
)
from loraplex.kernels.lora_expand import lora_expand, lora_expand_ref
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.lora_shrink import lora_shrink, lora_shrink_ref


def ceilings() -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s), measured now."""
    src = torch.randn(2**29, device=DEVICE, dtype=DT)  # 1 GiB
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bw = 2 * src.numel() * 2 / (t * 1e-3)
    a = torch.randn(8192, 8192, device=DEVICE, dtype=DT)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=DT)
    t = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return bw, 2 * 8192**3 / (t * 1e-3)


def scenarios(quick: bool) -> list[dict]:
    out = []
    for rank in (16, 64):
        for T in (1, 16, 64, 256):
            for adapters in (1, 8, 64):
                a = min(adapters, T)
                if adapters > T and a != T:
                    continue
                name = f"decode T={T} adapters={adapters} r={rank}"
                if any(s["tokens"] == T and s["distinct"] == a and s["rank"] == rank for s in out):
                    continue
                out.append(dict(name=name, tokens=T, distinct=a, rank=rank, prefill=False))
        out.append(
            dict(name=f"prefill 8x512 adapters=8 r={rank}", tokens=4096, distinct=8, rank=rank, prefill=True)
        )
    if quick:
        out = [s for s in out if (s["tokens"], s["distinct"]) in ((64, 64), (64, 8), (256, 64), (4096, 8))]
    return out


def configs_for(sc: dict, group: str, overrides: dict) -> tuple[ShrinkConfig, int, ExpandConfig]:
    """(shrink config, K-splits, expand config): the sweep's choice if any, else the repo's table."""
    d, widths = GROUPS[group]
    n, r, T = len(widths), sc["rank"], sc["tokens"]
    if group in overrides:  # block sizes from the sweep; K-splits always the table's
        s_cfg, _, e_cfg = overrides[group]
        return s_cfg, shrink_splits(d, T), e_cfg
    return shrink_config(d, n, r, T), shrink_splits(d, T), expand_config(sum(widths), n, r, T)


def triton_fns(copies: list[dict], segs, sc: dict, overrides: dict) -> dict[str, list]:
    """name -> one zero-arg callable per copy: 'g.shrink', 'g.expand' for each group."""
    T = sc["tokens"]
    fns: dict[str, list] = {}
    for g, (_, widths) in GROUPS.items():
        launch = launch_of(sc, *configs_for(sc, g, overrides))
        y = torch.zeros(launch.splits, T, len(widths) * sc["rank"], device=DEVICE, dtype=torch.float32)
        fns[f"{g}.shrink"] = [
            (lambda c=c[g], y=y, launch=launch: lora_shrink(c["x"], c["A"], c["ranks"], segs, y, launch))
            for c in copies
        ]
        fns[f"{g}.expand"] = [
            (
                lambda c=c[g], y=y, w=widths, launch=launch: lora_expand(
                    y, c["B"], c["ranks"], c["scal"], segs, c["out"], w, launch
                )
            )
            for c in copies
        ]
    return fns


def torch_layer_fns(copies: list[dict], slots: torch.Tensor, sc: dict) -> list:
    """A plain torch loop over segments (host-known), one callable per copy."""
    r = sc["rank"]
    segments = [(s, (slots == s).nonzero().flatten()) for s in range(sc["distinct"])]

    def layer(c: dict) -> None:
        for g, (_, widths) in GROUPS.items():
            p = c[g]
            for s, idx in segments:
                h = p["x"].index_select(0, idx) @ p["A"][s].t()
                parts, off = [], 0
                for i, w in enumerate(widths):
                    parts.append((h[:, i * r : (i + 1) * r] @ p["B"][s, off : off + w].t()) * p["scal"][s, i])
                    off += w
                p["out"].index_add_(0, idx, torch.cat(parts, 1))

    return [(lambda c=c: layer(c)) for c in copies]


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def check_bf16(copy: dict, segs, sc: dict, overrides: dict) -> float:
    """Worst relative error of the layer's deltas, Triton vs torch reference, in bf16."""
    worst = 0.0
    T = sc["tokens"]
    for g, (_, widths) in GROUPS.items():
        p = copy[g]
        launch = launch_of(sc, *configs_for(sc, g, overrides))
        y = torch.full((launch.splits, T, len(widths) * sc["rank"]), float("nan"), device=DEVICE)
        y_ref = torch.full_like(y, float("nan"))
        lora_shrink(p["x"], p["A"], p["ranks"], segs, y, launch)
        lora_shrink_ref(p["x"], p["A"], p["ranks"], segs, y_ref)
        out, out_ref = p["out"].clone(), p["out"].clone()
        lora_expand(y, p["B"], p["ranks"], p["scal"], segs, out, widths, launch)
        lora_expand_ref(y_ref, p["B"], p["ranks"], p["scal"], segs, out_ref, widths)
        delta, delta_ref = (out.float() - p["out"].float()), (out_ref.float() - p["out"].float())
        err = ((delta - delta_ref).norm() / delta_ref.norm()).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst


def run_scenario(sc: dict, bw: float, rate: float, overrides: dict) -> dict:
    T = sc["tokens"]
    per_copy = sum(floor_of(sc, g, k, bw, rate)[1] for g in GROUPS for k in ("shrink", "expand"))
    copies = make_copies(sc, per_copy)
    slots = token_slots(sc)
    segs = build_segments(slots, alloc_segments(T, sc["distinct"], DEVICE))
    err = check_bf16(copies[0], segs, sc, overrides)
    if not err < 2e-2:
        raise SystemExit(f"{sc['name']}: bf16 kernel vs reference rel err {err:.3g}")
    res = dict(
        sc,
        copies=len(copies),
        bf16_rel_err=err,
        kernels={},
        configs={
            g: [c if isinstance(c, int) else c._asdict() for c in configs_for(sc, g, overrides)]
            for g in GROUPS
        },
    )
    fns = triton_fns(copies, segs, sc, overrides)
    tot_bytes = tot_flops = 0.0
    for name, per in fns.items():
        g, k = name.split(".")
        fl, nbytes, flops = floor_of(sc, g, k, bw, rate)
        tot_bytes, tot_flops = tot_bytes + nbytes, tot_flops + flops
        res["kernels"][name] = dict(floor_us=fl * 1e6, bench_us=bench_us(per[0]), graph_us=graph_time_us(per))
    layer = [(lambda i=i, fns=fns: [f[i]() for f in fns.values()]) for i in range(len(copies))]
    floor = max(tot_bytes / bw, tot_flops / rate) * 1e6
    res["layer"] = dict(
        floor_us=floor,
        bytes=tot_bytes,
        flops=tot_flops,
        bench_us=bench_us(layer[0]),
        graph_us=graph_time_us(layer),
    )
    torch_fns = torch_layer_fns(copies, slots, sc)[: max(1, 64 // sc["distinct"])]
    res["torch_layer"] = dict(bench_us=bench_us(torch_fns[0]), graph_us=graph_time_us(torch_fns, replays=5))
    res["build_segments_us"] = bench_us(lambda: build_segments(slots, segs))
    del copies, layer, torch_fns
    torch.cuda.empty_cache()
    return res


def print_table(results: list[dict]) -> None:
    print(f"\n{'scenario':34} {'kernel':15} {'floor':>7} {'bench':>8} {'x':>5} {'graph':>8} {'x':>5}")
    for r in results:
        rows = list(r["kernels"].items()) + [("LAYER", r["layer"])]
        for name, k in rows:
            # Per-kernel rows for the goal scenarios; the layer sum for every scenario.
            if name != "LAYER" and not is_goal(r):
                continue
            f = k["floor_us"]
            print(
                f"{r['name']:34} {name:15} {f:7.1f} {k['bench_us']:8.1f} {k['bench_us'] / f:5.2f}"
                f" {k['graph_us']:8.1f} {k['graph_us'] / f:5.2f}"
            )
        t = r["torch_layer"]
        print(
            f"{r['name']:34} {'torch loop':15} {r['layer']['floor_us']:7.1f} {t['bench_us']:8.1f}"
            f" {t['bench_us'] / r['layer']['floor_us']:5.2f} {t['graph_us']:8.1f}"
            f" {t['graph_us'] / r['layer']['floor_us']:5.2f}"
        )


def is_goal(sc: dict) -> bool:
    return (sc["tokens"], sc["distinct"]) in ((64, 64), (4096, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="tune block sizes on the goal scenarios first")
    parser.add_argument("--quick", action="store_true", help="only the goal scenarios")
    parser.add_argument(
        "--joint-sweep",
        action="store_true",
        help="choose decode K-splits and block sizes for batch 64 over 8 and over 64 adapters at "
        "once; writes lora_configs.json (LORAPLEX_LORA_CONFIGS) to --out and applies it to this run",
    )
    add_out_argument(parser)
    args = parser.parse_args()
    t0 = time.time()
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}",
        flush=True,
    )
    small = [run_case(c._replace(dtype="bfloat16"), DEVICE) for c in CASES]
    bad = [
        c.name
        for c in small
        if not (
            c.shrink_rel_err < 2e-2
            and c.expand_rel_err < 2e-2
            and c.y_written_exactly
            and c.untouched_rows_equal
            and c.delta_mode_rel_err < 2e-2
            and c.delta_mode_untouched
        )
    ]
    print(
        f"bf16 small cases: worst shrink {max(c.shrink_rel_err for c in small):.2e}"
        f" expand {max(c.expand_rel_err for c in small):.2e}; failing: {bad}",
        flush=True,
    )
    if bad:
        raise SystemExit(1)
    bw, rate = ceilings()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    payload = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="PYTHONPATH=protos python3 -m loraplex.bench.lora_kernels " + " ".join(sys.argv[1:]),
        copy_bw=bw,
        bf16_rate=rate,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        small_bf16_cases=[c._asdict() for c in small],
        results=[],
        sweep=[],
        table=[],
    )
    overrides: dict[tuple[str, int], dict] = {}
    all_scenarios = scenarios(args.quick)
    if args.joint_sweep:
        for sc in all_scenarios:  # the table as it was, for the comparison
            if sc["tokens"] == 64 and not sc["prefill"] and sc["rank"] == 16:
                res = run_scenario(sc, bw, rate, {})
                payload.setdefault("before_joint_sweep", []).append(dict(name=sc["name"], layer=res["layer"]))
                print(f"before: {sc['name']:36} layer {res['layer']['graph_us']:7.1f}us", flush=True)
        joint = [
            sc
            for sc in all_scenarios
            if sc["tokens"] == 64 and not sc["prefill"] and sc["rank"] == 16 and sc["distinct"] in (8, 64)
        ]
        chosen, rows = joint_sweep(joint)
        payload["joint_sweep"], payload["joint_sweep_rows"] = chosen, rows
        cfg_path = write_json(args.out, "lora_configs", chosen)
        load_overrides(str(cfg_path))
        print(
            f"joint sweep chose {json.dumps(chosen)}; wrote {cfg_path} [{time.time() - t0:.0f}s]", flush=True
        )
    if args.sweep:
        for sc in filter(is_goal, all_scenarios):
            best, rows = sweep(sc)
            overrides[(family(sc["tokens"]), sc["rank"])] = best
            payload["sweep"] += rows
            payload["table"] += table_entries(sc, best)
            print(f"[{time.time() - t0:.0f}s]", flush=True)
        print("\n".join(payload["table"]), flush=True)
    for sc in all_scenarios:
        res = run_scenario(sc, bw, rate, overrides.get((family(sc["tokens"]), sc["rank"]), {}))
        payload["results"].append(res)
        write_json(args.out, "lora_kernels", payload)  # after each scenario: a late failure keeps the rest
        lay = res["layer"]
        print(
            f"{sc['name']:36} layer floor {lay['floor_us']:7.1f}us graph {lay['graph_us']:7.1f}us"
            f" ({lay['graph_us'] / lay['floor_us']:.2f}x) bench {lay['bench_us']:7.1f}us"
            f" torch {res['torch_layer']['graph_us']:8.1f}us  [{time.time() - t0:.0f}s]",
            flush=True,
        )
    print_table(payload["results"])
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
