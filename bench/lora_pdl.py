"""GPU benchmark: the LoRA shrink and expand with and without programmatic dependent launch (PDL,
`LORAPLEX_LORA_PDL`), per Llama-3.1-8B layer and in the engine's batch-64 decode step, in one run.

    PYTHONPATH=protos python3 -m loraplex.bench.lora_pdl [--steps 30] [--no-step] [--out DIR]

With PDL the expand's programs start while the shrink drains its stores and read their first B tile
before waiting for the shrink's `y` (kernels/lora_expand.py), so the launch gap and the expand's
first load leave the critical path.

1. Per layer: issue 38's four scenarios (bench/lora_fused.py's), the two-kernel path of all four
   groups in one CUDA graph per copy of the inputs (copies > 4x L2), PDL off and on; the outputs of
   one run of each must be bit-identical (the same arithmetic), else FAIL and exit status 1.
   Floors: the A/B and activation bytes at the H200's 4.25 TB/s (the issue's) and at this card's
   measured copy rate.
2. The decode step (unless --no-step): a random Llama-3.1-8B-shaped ModelRunner, batch 64, ctx 1,024,
   64 rank-16 adapters on every projection, its decode CUDA graphs captured with PDL off, then
   recaptured with it on; ms a step for the base model, 8 and 64 distinct adapters, and the
   64-adapter step's logits off vs on (must be bit-identical).
"""

from __future__ import annotations

import argparse
import os
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
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.settings import reload_kernel_settings


def set_pdl(on: bool) -> None:
    reload_kernel_settings(dict(os.environ, LORAPLEX_LORA_PDL="1" if on else "0"))


def layer_outputs(copy: dict, sc: dict, segs, ys: dict, delta: bool, pdl: bool) -> list[torch.Tensor]:
    """Every group's output after one two-kernel run from the copy's saved state."""
    set_pdl(pdl)
    outs = []
    for g in GROUPS:
        target = copy[g]["delta" if delta else "out"]
        saved = target.clone()
        two_kernel_fn(copy, g, segs, group_launch(sc, g), ys[g], delta)()
        outs.append(target.clone())
        target.copy_(saved)
    torch.cuda.synchronize()
    return outs


def per_layer(sc: dict, bw: float) -> tuple[dict, bool]:
    floor_b = sum(floor_bytes(sc, g) for g in GROUPS)
    copies = make_copies(sc, floor_b)
    add_delta_buffers(copies, sc)
    segs = build_segments(token_slots(sc), alloc_segments(sc["tokens"], sc["distinct"], DEVICE))
    ys = shrink_buffers(sc)
    delta = not sc["prefill"]  # the engine's mode: decode in the side stream's delta, prefill in place
    off = layer_outputs(copies[0], sc, segs, ys, delta, pdl=False)
    on = layer_outputs(copies[0], sc, segs, ys, delta, pdl=True)
    identical = all(torch.equal(a, b) for a, b in zip(off, on, strict=True))
    row = dict(
        name=sc["name"], mode="delta" if delta else "in place", copies=len(copies), identical=identical
    )
    row["h200_floor_us"] = floor_b / H200_COPY_BW * 1e6
    row["card_floor_us"] = floor_b / bw * 1e6
    for pdl in (False, True):
        set_pdl(pdl)
        row["pdl_us" if pdl else "off_us"] = layer_us(
            copies,
            lambda c, g: two_kernel_fn(c, g, segs, group_launch(sc, g), ys[g], delta),
        )
    set_pdl(False)
    del copies
    torch.cuda.empty_cache()
    return row, identical


def decode_step(opts: argparse.Namespace, device: torch.device, bw: float) -> tuple[dict, bool]:
    run_opts = argparse.Namespace(batch=64, context=1024, adapters=64)
    set_pdl(False)
    runner, pages = decode_runner(LLAMA_8B, run_opts, device, graphs=True)
    runner.kv_cache.normal_()
    keys = list(runner.cuda_graphs.graphs)
    result: dict = dict(batch=64, context=1024, rank=16)
    logits = {}
    for pdl in (False, True):
        set_pdl(pdl)
        if pdl:
            runner.cuda_graphs.recapture(keys)
        name = "pdl" if pdl else "off"
        for adapters in (0, 8, 64):
            chunks = decode_chunks(run_opts, pages, adapters)
            ms = statistics.median(step_ms(runner, chunks, opts.steps, device) for _ in range(3))
            result[f"{name}_{adapters}_ms"] = ms
        logits[pdl] = runner.forward(decode_chunks(run_opts, pages, 64)).float().clone()
    set_pdl(False)
    identical = torch.equal(logits[False], logits[True])
    result["identical"] = identical
    del runner
    torch.cuda.empty_cache()
    return result, identical


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="decode steps per timing (median of 3)")
    p.add_argument("--no-step", action="store_true", help="per-layer kernels only")
    add_out_argument(p)
    opts = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("bench.lora_pdl needs a CUDA GPU of compute capability 9 or more (Hopper)")
        return 2
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    res: dict = dict(device=torch.cuda.get_device_name(), bandwidth=bw, layers=[])
    print(f"{res['device']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    ok = True
    print(
        f"\n{'scenario':32} {'mode':9} {'off us':>8} {'PDL us':>8} {'PDL/off':>8}"
        f" {'x H200 floor':>13} {'x card floor':>13}  outputs"
    )
    for sc in SCENARIOS:
        row, same = per_layer(sc, bw)
        ok &= same
        res["layers"].append(row)
        best = min(row["off_us"], row["pdl_us"])
        print(
            f"{row['name']:32} {row['mode']:9} {row['off_us']:8.1f} {row['pdl_us']:8.1f}"
            f" {row['pdl_us'] / row['off_us']:8.3f} {best / row['h200_floor_us']:13.2f}"
            f" {best / row['card_floor_us']:13.2f}  {'identical' if same else 'FAIL: differ'}",
            flush=True,
        )
    if not opts.no_step:
        step, same = decode_step(opts, device, bw)
        ok &= same
        res["decode_step"] = step
        check = "identical" if same else "FAIL: differ"
        print(f"\ndecode step, batch 64, ctx 1,024 (ms; logits off vs PDL {check})")
        print(f"{'adapters':>9} {'off':>8} {'PDL':>8} {'PDL/off':>8} {'vs base (PDL)':>14}")
        for a in (0, 8, 64):
            off, on = step[f"off_{a}_ms"], step[f"pdl_{a}_ms"]
            print(f"{a:>9} {off:8.3f} {on:8.3f} {on / off:8.3f} {step['pdl_0_ms'] / on:14.3f}")
    write_json(opts.out, "lora_pdl", res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
