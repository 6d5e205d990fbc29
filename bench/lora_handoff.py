"""GPU benchmark: the LoRA shrink and expand as one handoff launch (`LORAPLEX_LORA_HANDOFF`,
kernels/lora_handoff.py) against the two-kernel path (PDL as the engine sets it), per Llama-3.1-8B
layer and in the engine's batch-64 decode step, in one run.

    PYTHONPATH=protos python3 -m loraplex.bench.lora_handoff [--steps 30] [--no-step] [--out DIR]

1. Checks: kernels/lora_handoff_check.py's random cases on this GPU (1 to 256 adapters, K-splits,
   block and per-token expands, both modes) within the bf16/float32 tolerance of the two-kernel
   path and the torch references, counters left zero.
2. Per layer: issue 38's decode scenarios (bench/lora_fused.py's), all four groups in one CUDA graph
   per copy of the inputs (copies > 4x L2), two kernels vs handoff, in the engine's delta mode; the
   outputs of one run each compared (relative error, bit-identical or not) and the counters zero
   after every timed replay. Floors as bench/lora_pdl.py's.
3. The decode step (unless --no-step): a random Llama-3.1-8B-shaped ModelRunner, batch 64, ctx 1,024,
   64 rank-16 adapters on every projection, decode CUDA graphs captured with the handoff off, then
   recaptured with it on; ms a step for the base model, 8 and 64 distinct adapters, and the
   64-adapter step's logits off vs on.
Any check failing prints FAIL and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from loraplex.bench.families import copy_bandwidth, decode_chunks, decode_runner, step_ms
from loraplex.bench.lora_fused import SCENARIOS, layer_us
from loraplex.bench.lora_fused_sweep import (
    H200_COPY_BW,
    add_delta_buffers,
    floor_bytes,
    group_launch,
    shrink_buffers,
    two_kernel_fn,
)
from loraplex.bench.lora_layer import DEVICE, GROUPS, make_copies, token_slots
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.kernels.lora_handoff import alloc_handoff_counters, lora_handoff
from loraplex.kernels.lora_handoff_check import handoff_cases, passed, run_handoff_case
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.lora_plan import handoff_fits

TOL = 2e-2  # bf16 relative error of a layer's delta


def handoff_fn(c: dict, group: str, segs, y: torch.Tensor, counters: torch.Tensor, sc: dict):
    p, widths = c[group], GROUPS[group][1]
    launch = group_launch(sc, group)._replace(handoff=True)
    return lambda: lora_handoff(
        p["x"], p["A"], p["B"], p["ranks"], p["scal"], segs, y, p["delta"], widths, launch, counters, False
    )


def outputs(copy: dict, make) -> list[torch.Tensor]:
    """Every group's delta after one run of `make(copy, group)` from zero."""
    outs = []
    for g in GROUPS:
        copy[g]["delta"].zero_()
        make(copy, g)()
        outs.append(copy[g]["delta"].clone())
    torch.cuda.synchronize()
    return outs


def small_cases() -> bool:
    ok = True
    for hc in handoff_cases():
        r = run_handoff_case(hc, device="cuda")
        if not passed(r, hc.case.dtype, exact=False):
            print(f"FAIL handoff case {r}", flush=True)
            ok = False
    print(f"{len(handoff_cases())} random handoff cases on the GPU: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def per_layer(sc: dict, bw: float) -> tuple[dict, bool]:
    floor_b = sum(floor_bytes(sc, g) for g in GROUPS)
    copies = make_copies(sc, floor_b)
    add_delta_buffers(copies, sc)
    segs = build_segments(token_slots(sc), alloc_segments(sc["tokens"], sc["distinct"], DEVICE))
    ys = shrink_buffers(sc)
    counters = alloc_handoff_counters(sc["tokens"], DEVICE)
    handoff_ok = all(handoff_fits(group_launch(sc, g)) for g in GROUPS)
    two = outputs(copies[0], lambda c, g: two_kernel_fn(c, g, segs, group_launch(sc, g), ys[g], True))
    one = outputs(copies[0], lambda c, g: handoff_fn(c, g, segs, ys[g], counters, sc))
    err = max(((a - b).norm() / a.norm().clamp_min(1e-30)).item() for a, b in zip(two, one, strict=True))
    identical = all(torch.equal(a, b) for a, b in zip(two, one, strict=True))
    row = dict(name=sc["name"], copies=len(copies), rel_err=err, identical=identical)
    row["h200_floor_us"] = floor_b / H200_COPY_BW * 1e6
    row["card_floor_us"] = floor_b / bw * 1e6
    row["two_kernel_us"] = layer_us(
        copies, lambda c, g: two_kernel_fn(c, g, segs, group_launch(sc, g), ys[g], True)
    )
    row["handoff_us"] = layer_us(copies, lambda c, g: handoff_fn(c, g, segs, ys[g], counters, sc))
    row["counters_zero"] = not counters.any().item()
    ok = handoff_ok and err < TOL and row["counters_zero"]
    del copies
    torch.cuda.empty_cache()
    return row, ok


def decode_step(opts: argparse.Namespace, device: torch.device) -> tuple[dict, bool]:
    run_opts = argparse.Namespace(batch=64, context=1024, adapters=64)
    runner, pages = decode_runner(LLAMA_8B, run_opts, device, graphs=True)
    runner.kv_cache.normal_()
    backend = runner.lora_backend
    keys = list(runner.cuda_graphs.graphs)
    result: dict = dict(batch=64, context=1024, rank=16)
    logits = {}
    for on in (False, True):
        backend.handoff = on
        runner.cuda_graphs.recapture(keys)
        name = "handoff" if on else "off"
        for adapters in (0, 8, 64):
            chunks = decode_chunks(run_opts, pages, adapters)
            ms = statistics.median(step_ms(runner, chunks, opts.steps, device) for _ in range(3))
            result[f"{name}_{adapters}_ms"] = ms
        logits[on] = runner.forward(decode_chunks(run_opts, pages, 64)).float().clone()
    backend.handoff = False
    a, b = logits[False], logits[True]
    result["identical"] = torch.equal(a, b)
    result["logits_max_abs_diff"] = (a - b).abs().max().item()
    result["argmax_agree"] = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    result["counters_zero"] = not backend.handoff_counters.any().item()
    ok = result["argmax_agree"] == 1.0 and result["counters_zero"]
    del runner
    torch.cuda.empty_cache()
    return result, ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="decode steps per timing (median of 3)")
    p.add_argument("--no-step", action="store_true", help="checks and per-layer kernels only")
    add_out_argument(p)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.lora_handoff needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    res: dict = dict(device=torch.cuda.get_device_name(), bandwidth=bw, layers=[])
    print(f"{res['device']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    ok = res["small_cases_ok"] = small_cases()
    print(
        f"\n{'scenario':32} {'2-kernel us':>12} {'handoff us':>11} {'ratio':>7}"
        f" {'x H200 floor':>13} {'x card floor':>13} {'rel err':>9}  check"
    )
    for sc in [s for s in SCENARIOS if not s["prefill"]]:
        row, good = per_layer(sc, bw)
        ok &= good
        res["layers"].append(row)
        best = min(row["two_kernel_us"], row["handoff_us"])
        check = ("identical" if row["identical"] else "ok") if good else "FAIL"
        print(
            f"{row['name']:32} {row['two_kernel_us']:12.1f} {row['handoff_us']:11.1f}"
            f" {row['handoff_us'] / row['two_kernel_us']:7.3f} {best / row['h200_floor_us']:13.2f}"
            f" {best / row['card_floor_us']:13.2f} {row['rel_err']:9.2e}  {check}",
            flush=True,
        )
        write_json(opts.out, "lora_handoff", res)
    if not opts.no_step:
        step, good = decode_step(opts, device)
        ok &= good
        res["decode_step"] = step
        check = "identical" if step["identical"] else f"max |diff| {step['logits_max_abs_diff']:.3g}"
        print(
            f"\ndecode step, batch 64, ctx 1,024 (ms; 64-adapter logits off vs handoff: {check},"
            f" argmax agree {step['argmax_agree']:.3f}{'' if good else ' FAIL'})"
        )
        print(f"{'adapters':>9} {'off':>8} {'handoff':>8} {'ratio':>8} {'vs base (handoff)':>18}")
        for a in (0, 8, 64):
            off, on = step[f"off_{a}_ms"], step[f"handoff_{a}_ms"]
            print(f"{a:>9} {off:8.3f} {on:8.3f} {on / off:8.3f} {step['handoff_0_ms'] / on:18.3f}")
    write_json(opts.out, "lora_handoff", res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
