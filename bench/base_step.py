"""The base decode step's options (issue 38, "The base step"): the batch-64, ctx-1,024 decode CUDA graph
of a random Llama-3.1-8B-shaped model with each option off, alone and all on, against the memory floor.

    PYTHONPATH=protos python3 -m loraplex.bench.base_step [--batch 64] [--context 1024]
        [--sweep-budget-s 60] [--budget-s 180] [--no-profile] [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.base_step --tiny     # GPU smoke run: tiny shape, no sweep

Options (kernels/settings.py): LORAPLEX_SKINNY_GEMM, LORAPLEX_SKINNY_SILU, LORAPLEX_FUSED_KV_STORE,
LORAPLEX_DECODE_DIRECT, and cuBLASLt instead of cuBLAS for every matmul. Steps, in order:

1. Skinny GEMM sweep (within --sweep-budget-s): for each decode linear of the shape at --batch rows
   (qkv, o, gate_up, gate_up with SiLU, down, lm_head) block sizes, K splits, warps and stages,
   every candidate checked against torch first; prints each shape's cuBLAS, default-config and best
   times against its weight floor, installs the winners into `SKINNY_TABLE` for the rest of the run
   and writes them (`skinny_table.json` beside the JSON, entries to paste into kernels/skinny_gemm.py).
2. Exactness: one replay per variant (graph recaptured with the option set), logits and the new
   token's K/V rows against the options-off replay. Moving a write (fused KV store, direct decode)
   must be bit-identical ("identical"); "all on" must be bit-identical to the two skinny options
   alone; a skinny variant's logits must stay within 5% relative error with >= 90% of the greedy
   tokens equal (its sums run in another order). A miss prints FAIL and the exit status is 1.
3. Timing: median graph replay per variant, ms/step and x floor (every weight read once plus each
   sequence's K/V, over the copy bandwidth measured here). Goal: <= 1.15x floor (was 1.26x).
4. Profile (unless --no-profile): kernels per kind of one replay, options off and all on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from loraplex.bench.families import copy_bandwidth, decode_runner, kv_bytes, weight_bytes
from loraplex.bench.graph_timing import graph_time_us, replay_ms
from loraplex.bench.random_runner import TINY
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.kernels import skinny_gemm
from loraplex.kernels.fused_ops import silu_and_mul
from loraplex.kernels.settings import reload_kernel_settings
from loraplex.kernels.skinny_gemm import SkinnyConfig, SkinnyKey, default_config, rows_block
from loraplex.services.inference.engine.cuda_graph import DecodeGraphs

SKINNY, SILU = "LORAPLEX_SKINNY_GEMM", "LORAPLEX_SKINNY_SILU"
STORE, DIRECT = "LORAPLEX_FUSED_KV_STORE", "LORAPLEX_DECODE_DIRECT"
LT = "cublaslt"  # not a kernel setting: torch's preferred BLAS library for every matmul
VARIANTS = {
    "off": (),
    "cublaslt": (LT,),
    "silu + store + direct": (SILU, STORE, DIRECT),
    "cublaslt + silu + store + direct": (LT, SILU, STORE, DIRECT),
    "skinny gemm": (SKINNY,),
    "skinny silu": (SILU,),
    "skinny gemm + silu": (SKINNY, SILU),
    "fused kv store": (STORE,),
    "decode direct": (DIRECT,),
    "all on": (SKINNY, SILU, STORE, DIRECT),
}
# variant -> the variant it must equal bit for bit (it only moves writes or drops a launch)
IDENTICAL_TO = {"fused kv store": "off", "decode direct": "off", "all on": "skinny gemm + silu"}


def linear_shapes(shape: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (output columns, K, gated) of the decode step's matmuls."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    dim = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * dim
    return dict(
        qkv=(qkv, h, False),
        o=(h, h, False),
        gate_up=(2 * inter, h, False),
        gate_up_silu=(inter, h, True),
        down=(h, inter, False),
        lm_head=(shape["vocab_size"], h, False),
    )


def candidates(rows: int, n: int, k: int, gated: bool, device: torch.device, seed: int) -> list[SkinnyConfig]:
    """The default config first, then a shuffled grid (grids of about 0.5 to 16 programs per SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid = []
    for block_n in (16, 32, 64) if gated else (32, 64, 128):
        for block_k in (64, 128, 256):
            for split in (1, 2, 3, 4, 6, 8, 12):
                programs = -(-n // block_n) * split
                if not sms // 2 <= programs <= 16 * sms or split * block_k * 2 > k:
                    continue
                for warps in (4, 8):
                    for stages in (3, 4, 5):
                        grid.append(SkinnyConfig(block_n, block_k, split, warps, stages))
    random.Random(seed).shuffle(grid)
    first = default_config(rows, n, k, gated, device)
    return [first] + [c for c in grid if c != first]


def sweep(shape: dict, rows: int, budget_s: float, bw: float, device: torch.device) -> tuple[dict, list[str]]:
    """Round-robin over the shapes' candidates until the budget is spent: per shape the cuBLAS time,
    the default config's, the best (each checked against torch before it is timed)."""
    start = time.perf_counter()
    failures: list[str] = []
    result: dict = {}
    state = {}
    for name, (n, k, gated) in linear_shapes(shape).items():
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n * (2 if gated else 1), k, device=device, dtype=torch.bfloat16) / k**0.5
        ref = silu_and_mul(torch.nn.functional.linear(x, w)) if gated else torch.nn.functional.linear(x, w)
        if gated:
            cublas = graph_time_us([lambda x=x, w=w: silu_and_mul(torch.nn.functional.linear(x, w))])
        else:
            cublas = graph_time_us([lambda x=x, w=w: torch.nn.functional.linear(x, w)])
        floor = w.numel() * 2 / bw * 1e6
        result[name] = dict(n=n, k=k, gated=gated, floor_us=floor, cublas_us=cublas, tried=0, failed=0)
        state[name] = (x, w, ref, iter(candidates(rows, n, k, gated, device, seed=len(state))))
    live = list(state)
    while live and time.perf_counter() - start < budget_s:
        for name in list(live):
            x, w, ref, it = state[name]
            cfg = next(it, None)
            if cfg is None:
                live.remove(name)
                continue
            r = result[name]
            fn = skinny_gemm.skinny_gated if r["gated"] else skinny_gemm.skinny_linear
            try:
                got = fn(x, w, config=cfg)
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory or registers: skip the config
                r["failed"] += 1
                print(f"  {name} {tuple(cfg)}: skipped ({type(e).__name__})")
                continue
            err = float((got.float() - ref.float()).abs().max()) / (float(ref.float().abs().max()) + 1e-6)
            if err > 2e-2:
                failures.append(f"skinny {name} {tuple(cfg)}: max err {err:.2e} vs torch")
                print(f"FAIL {failures[-1]}")
                continue
            us = graph_time_us([lambda x=x, w=w, cfg=cfg, fn=fn: fn(x, w, config=cfg)])
            r["tried"] += 1
            if cfg == default_config(rows, r["n"], r["k"], r["gated"], device):
                r["default_us"], r["default"] = us, list(cfg)
            if us < r.get("best_us", float("inf")):
                r["best_us"], r["best"] = us, list(cfg)
            if time.perf_counter() - start >= budget_s:
                break
    print(f"\nskinny GEMM sweep, {rows} rows ({time.perf_counter() - start:.0f} s):")
    print(
        f"{'linear':<14}{'N':>8}{'K':>7}{'floor us':>10}{'cuBLAS':>9}{'default':>9}{'best':>9}{'tried':>7}"
        "  best config"
    )
    for name, r in result.items():
        d, b = r.get("default_us", float("nan")), r.get("best_us", float("nan"))
        print(
            f"{name:<14}{r['n']:>8}{r['k']:>7}{r['floor_us']:>10.1f}{r['cublas_us']:>9.1f}{d:>9.1f}{b:>9.1f}"
            f"{r['tried']:>7}  {r.get('best')}"
        )
    return result, failures


def install(result: dict, rows: int) -> dict[str, list]:
    """The sweep's winners into SKINNY_TABLE (only where they beat the default config)."""
    entries = {}
    for r in result.values():
        if "best" in r and r["best_us"] < r.get("default_us", float("inf")):
            key = SkinnyKey(rows_block(rows), r["n"], r["k"], r["gated"])
            skinny_gemm.SKINNY_TABLE[key] = SkinnyConfig(*r["best"])
            entries[repr(tuple(key))] = r["best"]
    if entries:
        print("SKINNY_TABLE entries (kernels/skinny_gemm.py):")
        for key, cfg in entries.items():
            print(f"    SkinnyKey{key}: SkinnyConfig{tuple(cfg)},")
    return entries


def set_options(names: tuple[str, ...]) -> None:
    """The process environment (LORAPLEX_LORA_CONFIGS kept) with exactly these options on, and
    cuBLASLt or cuBLAS for every matmul."""
    env = {k: v for k, v in os.environ.items() if k not in (SKINNY, SILU, STORE, DIRECT)}
    reload_kernel_settings(env | {n: "1" if n in names else "0" for n in (SKINNY, SILU, STORE, DIRECT)})
    torch.backends.cuda.preferred_blas_library("cublaslt" if LT in names else "cublas")


def replay_once(
    graphs: DecodeGraphs, runner, batch: int, context: int, pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recapture the batch's graph under the current options, run it once through `DecodeGraphs.run`
    (inputs uploaded): (logits, the new token's K/V rows of every layer)."""
    graphs.recapture([(batch, 0)])
    tables = [list(range(1 + b * pages, 1 + (b + 1) * pages)) for b in range(batch)]
    pos = context - 1
    slots = [t[pos // 16] * 16 + pos % 16 for t in tables]
    ids = [7 + b for b in range(batch)]
    logits = graphs.run(
        ids,
        [pos] * batch,
        slots,
        [-1] * batch,
        0,
        [t[: pos // 16 + 1] for t in tables],
        [context] * batch,
        list(range(batch)),
    )
    torch.cuda.synchronize()
    cache = runner.kv_cache.flatten(2, 3)  # [layers, 2, pages * page, kv heads, head dim]
    rows = cache[:, :, torch.tensor(slots, device=cache.device)].clone()
    return logits.clone(), rows


def compare(name: str, got: tuple, want: tuple, exact: bool) -> tuple[str, bool]:
    (logits, kv), (ref, ref_kv) = got, want
    if exact:
        ok = torch.equal(logits, ref) and torch.equal(kv, ref_kv)
        return ("identical" if ok else "NOT identical"), ok
    rel = float((logits - ref).norm() / ref.norm())
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    return f"logits rel err {rel:.2e}, greedy tokens equal {agree:.0%}", rel < 0.05 and agree >= 0.9


def profile(graph: torch.cuda.CUDAGraph, path: Path) -> dict:
    from loraplex.bench.profile_step import kind, trace_replay

    kinds: dict[str, list] = {}
    for e in trace_replay(graph, path):
        k = "gemm" if "skinny" in e["name"] else kind(e["name"])
        c = kinds.setdefault(k, [0, 0.0])
        c[0], c[1] = c[0] + 1, c[1] + e["dur"]
    return {k: dict(count=c, us=round(t, 1)) for k, (c, t) in sorted(kinds.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence (the decoded one included)")
    p.add_argument("--reps", type=int, default=50, help="timed replays per variant")
    p.add_argument("--sweep-budget-s", type=float, default=60.0)
    p.add_argument("--budget-s", type=float, default=180.0, help="stop timing variants past this (whole run)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny shape, batch 8, no sweep (GPU smoke run)")
    add_out_argument(p)
    opts = p.parse_args()
    if not torch.cuda.is_available():
        print("bench.base_step needs a CUDA GPU")
        return 2
    start = time.perf_counter()
    opts.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    shape = TINY if opts.tiny else LLAMA_8B
    if opts.tiny:
        opts.batch, opts.context, opts.sweep_budget_s, opts.reps = (
            min(opts.batch, 8),
            min(opts.context, 64),
            0,
            5,
        )
    if opts.batch > skinny_gemm.SKINNY_MAX_ROWS:
        print(
            f"note: batch {opts.batch} is past the skinny GEMM's {skinny_gemm.SKINNY_MAX_ROWS} rows"
            " (cuBLAS serves it)"
        )
    bw = copy_bandwidth(device)
    res: dict = dict(
        device=torch.cuda.get_device_name(), batch=opts.batch, context=opts.context, bandwidth=bw
    )
    print(f"{res['device']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    failures: list[str] = []
    if opts.sweep_budget_s > 0:
        res["sweep"], failures = sweep(shape, opts.batch, opts.sweep_budget_s, bw, device)
        res["skinny_table"] = install(res["sweep"], opts.batch)
        (opts.out / "skinny_table.json").write_text(json.dumps(res["skinny_table"], indent=1))

    run_opts = argparse.Namespace(batch=opts.batch, context=opts.context, adapters=0)
    runner, pages = decode_runner(shape, run_opts, device, graphs=False)
    runner.kv_cache.normal_()  # real-looking attention (an all-zero cache would weigh keys evenly)
    a = runner.attention
    graphs = DecodeGraphs(runner.model, runner.kv_cache, a, None, max_bs=opts.batch, max_blocks_per_seq=pages)
    floor_ms = (weight_bytes(runner) + kv_bytes(runner, opts.batch, opts.context)) / bw * 1e3
    res["floor_ms"], res["variants"] = floor_ms, {}
    outputs: dict[str, tuple] = {}
    print(f"\nbatch {opts.batch}, ctx {opts.context}: floor {floor_ms:.2f} ms")
    print(f"{'variant':<22}{'ms/step':>9}{'x floor':>9}{'vs off':>8}  check")
    for name, names in VARIANTS.items():
        if time.perf_counter() - start > opts.budget_s and name != "all on":
            print(f"{name:<22} skipped (--budget-s)")
            continue
        set_options(names)
        outputs[name] = replay_once(graphs, runner, opts.batch, opts.context, pages)
        check, ok = "reference", True
        if name != "off":
            want = IDENTICAL_TO.get(name, "off")
            if want in outputs:
                check, ok = compare(name, outputs[name], outputs[want], exact=name in IDENTICAL_TO)
                check += f" (vs {want})"
        if not ok:
            failures.append(f"{name}: {check}")
        ms = statistics.median(replay_ms(graphs.graphs[(opts.batch, 0)], opts.reps))
        off = res["variants"].get("off", {}).get("ms", ms)
        res["variants"][name] = dict(
            options=list(names), ms=ms, x_floor=ms / floor_ms, vs_off=off / ms, check=check, ok=ok
        )
        print(f"{name:<22}{ms:>9.3f}{ms / floor_ms:>9.3f}{off / ms:>8.3f}  {'' if ok else 'FAIL '}{check}")
        if not opts.no_profile and name in ("off", "all on", "cublaslt + silu + store + direct"):
            res["variants"][name]["kinds"] = prof = profile(
                graphs.graphs[(opts.batch, 0)], opts.out / f"trace_{name.replace(' ', '_')}.json"
            )
            print(
                "    per kind (count/us): "
                + ", ".join(f"{k} {v['count']}/{v['us']:.0f}" for k, v in prof.items())
            )
    set_options(())
    res["failures"] = failures
    write_json(opts.out, "base_step", res)
    for f in failures:
        print(f"FAIL {f}")
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
