"""GPU benchmark: the fused LoRA shrink->expand (kernels/lora_fused.py) against the current two launches
per group, per Llama-3.1-8B layer, with CUDA graphs, against the memory floor.

    PYTHONPATH=protos python3 -m loraplex.bench.lora_fused [--budget-s 150] [--out DIR]

Checks first (exits non-zero with FAIL lines on a mismatch): the randomized small cases of
`loraplex.kernels.lora_fused_check` in bf16 on the GPU, then each scenario's full-size groups,
fused vs the torch reference in both modes, for the default and the chosen configs.

Scenarios (issue 38's per-layer goals): decode 64 tokens over 64 and over 8 adapters at rank 16,
over 64 adapters at rank 64, prefill 8x512 over 8 adapters at rank 16; all four groups of a layer
(qkv 4096->4096+1024+1024, o 4096->4096, gate_up 4096->2x14336, down 14336->4096). Decode runs in the
side stream's delta mode (what the engine runs) and in place; prefill in place. Per scenario a sweep
of fused block sizes within the budget picks each group's best; then the layer (all groups in one
graph per copy of the inputs, copies > 4x L2) is timed two-kernel vs fused-default vs fused-best.
floor = A/B bytes of the step's adapters + activations (bench/lora_fused_sweep.py `floor_bytes`) at
4.25 TB/s, the H200 copy rate. Writes lora_fused.json, and lora_fused_configs.json: the chosen configs
of the groups where fused beat the two launches in the engine's mode, in FUSED_TABLE's format
(`LORAPLEX_LORA_CONFIGS=.../lora_fused_configs.json`, or paste into kernels/lora_configs.py).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import triton

from loraplex.bench.graph_timing import graph_time_us
from loraplex.bench.lora_fused_sweep import (
    H200_COPY_BW,
    add_delta_buffers,
    check_fused,
    floor_bytes,
    fused_fn,
    fused_key,
    group_launch,
    shrink_buffers,
    sweep_group,
    time_or_inf,
    two_kernel_fn,
)
from loraplex.bench.lora_layer import DEVICE, GROUPS, make_copies, token_slots
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.lora_configs import fused_default_config
from loraplex.kernels.lora_fused_check import fused_cases, run_fused_case
from loraplex.kernels.lora_meta import alloc_segments, build_segments

SCENARIOS = [
    dict(name="decode T=64 adapters=64 r=16", tokens=64, distinct=64, rank=16, prefill=False),
    dict(name="decode T=64 adapters=8 r=16", tokens=64, distinct=8, rank=16, prefill=False),
    dict(name="decode T=64 adapters=64 r=64", tokens=64, distinct=64, rank=64, prefill=False),
    dict(name="prefill 8x512 adapters=8 r=16", tokens=4096, distinct=8, rank=16, prefill=True),
]
TOL = 2e-2  # bf16 relative error of the delta


def small_cases_ok() -> bool:
    """The CPU test's random cases in bf16 on the GPU (the in-place add may contract into an FMA
    here, so `delta_adds_up` is not required)."""
    ok = True
    for fc in fused_cases():
        fc = fc._replace(case=fc.case._replace(dtype="bfloat16"))
        r = run_fused_case(fc, DEVICE)
        good = (
            r.rel_err < TOL
            and r.delta_rel_err < TOL
            and r.vs_two_kernel_rel_err < TOL
            and r.untouched_rows_equal
            and r.delta_untouched
        )
        if not good:
            print(f"FAIL small case {r.name}: {r._asdict()}", flush=True)
        ok &= good
    return ok


def layer_us(copies: list[dict], make) -> float:
    """Graph time per copy of running every group's `make(copy, group)` callable."""
    per_copy = [[make(c, g) for g in GROUPS] for c in copies]
    return graph_time_us([(lambda fs=fs: [f() for f in fs]) for fs in per_copy])


def run_scenario(sc: dict, sweep_budget_s: float) -> tuple[dict, dict[str, list], bool]:
    T = sc["tokens"]
    floor_b = sum(floor_bytes(sc, g) for g in GROUPS)
    copies = make_copies(sc, floor_b)
    add_delta_buffers(copies, sc)
    segs = build_segments(token_slots(sc), alloc_segments(T, sc["distinct"], DEVICE))
    modes = ["in_place"] if sc["prefill"] else ["delta", "in_place"]
    res = dict(sc, copies=len(copies), floor_bytes=floor_b, floor_us=floor_b / H200_COPY_BW * 1e6, modes={})
    ok, chosen, rows, per_group = True, {}, [], {}
    default = fused_default_config(T)
    ys = shrink_buffers(sc)
    engine_delta = modes[0] == "delta"  # sweep in the mode the engine runs this step size in
    for g in GROUPS:
        cfg, us, r = sweep_group(sc, g, copies, segs, engine_delta, sweep_budget_s / len(GROUPS))
        chosen[g] = cfg
        rows += r
        for name, c in (("default", default), ("best", cfg)):
            err = check_fused(copies[0], sc, g, segs, c)
            if not err < TOL:
                print(f"FAIL {sc['name']} {g} fused {name} {c}: rel err {err:.3g}", flush=True)
                ok = False
        two = time_or_inf(
            [two_kernel_fn(c, g, segs, group_launch(sc, g), ys[g], engine_delta) for c in copies]
        )
        per_group[g] = dict(
            fused_best_us=us, two_kernel_us=two, floor_us=floor_bytes(sc, g) / H200_COPY_BW * 1e6
        )
        print(
            f"  {sc['name']} {g}: fused best {tuple(cfg)} {us:.1f}us vs two-kernel {two:.1f}us"
            f" (floor {per_group[g]['floor_us']:.1f}us; {len(r)} configs timed)",
            flush=True,
        )
    for mode in modes:
        delta = mode == "delta"
        paths = {
            "two_kernel": lambda c, g, delta=delta: two_kernel_fn(
                c, g, segs, group_launch(sc, g), ys[g], delta
            ),
            "fused_default": lambda c, g, delta=delta: fused_fn(
                c, g, segs, group_launch(sc, g)._replace(fused=default), delta
            ),
            "fused_best": lambda c, g, delta=delta: fused_fn(
                c, g, segs, group_launch(sc, g)._replace(fused=chosen[g]), delta
            ),
        }
        res["modes"][mode] = {name: dict(graph_us=layer_us(copies, make)) for name, make in paths.items()}
        for name in paths:
            t = res["modes"][mode][name]["graph_us"]
            res["modes"][mode][name]["x_floor"] = t / res["floor_us"]
    res["chosen"] = {g: cfg._asdict() for g, cfg in chosen.items()}
    res["per_group"] = per_group
    res["sweep"] = rows
    # Only where fused beat the two launches: under `auto` an entry switches its group to fused.
    configs = {
        fused_key(sc, g): list(cfg)
        for g, cfg in chosen.items()
        if per_group[g]["fused_best_us"] < per_group[g]["two_kernel_us"]
    }
    del copies
    torch.cuda.empty_cache()
    return res, configs, ok


def print_table(results: list[dict]) -> None:
    print(f"\n{'scenario':32} {'mode':9} {'path':14} {'floor us':>9} {'graph us':>9} {'x floor':>8}")
    for r in results:
        for mode, paths in r["modes"].items():
            for name, p in paths.items():
                print(
                    f"{r['name']:32} {mode:9} {name:14} {r['floor_us']:9.1f} {p['graph_us']:9.1f}"
                    f" {p['x_floor']:8.2f}"
                )
    print(
        f"\n{'scenario (engine mode)':32} {'group':9} {'floor us':>9} {'two-kernel':>11} {'fused best':>11}"
    )
    for r in results:
        for g, p in r["per_group"].items():
            print(
                f"{r['name']:32} {g:9} {p['floor_us']:9.1f} {p['two_kernel_us']:11.1f}"
                f" {p['fused_best_us']:11.1f}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=150.0, help="total seconds, roughly (default 150)")
    add_out_argument(parser)
    args = parser.parse_args()
    t0 = time.time()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if not small_cases_ok():
        return 1
    print(f"small bf16 cases ok [{time.time() - t0:.0f}s]", flush=True)
    payload = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="PYTHONPATH=protos python3 -m loraplex.bench.lora_fused " + " ".join(sys.argv[1:]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        copy_bw_floor=H200_COPY_BW,
        results=[],
    )
    configs: dict[str, list] = {}
    all_ok = True
    for i, sc in enumerate(SCENARIOS):
        left = args.budget_s - (time.time() - t0)
        # Half of what is left per scenario goes to its sweep; the rest to checks and layer timing.
        res, found, ok = run_scenario(sc, max(1.0, 0.5 * left / (len(SCENARIOS) - i)))
        all_ok &= ok
        payload["results"].append(res)
        configs.update(found)
        write_json(args.out, "lora_fused", payload)  # after each scenario: a late failure keeps the rest
        print(f"{sc['name']} done [{time.time() - t0:.0f}s]", flush=True)
    path = write_json(args.out, "lora_fused_configs", {"fused": configs})
    print_table(payload["results"])
    print(f"wrote {path}; done in {time.time() - t0:.0f}s{'' if all_ok else ' (FAILURES above)'}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
