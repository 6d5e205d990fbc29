"""Tunes the Triton FP8 GEMMs (kernels/fp8_weight_gemm.py: weight-only and W8A8) for a card or model
shape the built-in tables were not measured on, and writes `fp8_gemm_configs.json`, which
`LORAPLEX_FP8_GEMM_CONFIGS` loads (docs/operations.md).

1. Correctness (first; FAIL lines and exit 1 on a mismatch): each Llama-3.1-8B projection (q/k/v
   fused, o, gate/up fused, down) at every `--rows`, per-channel and 128x128 block scales, bf16
   activations, against the float32 reference over the dequantized weight.
2. Sweep (`--sweep-budget-s`, rows `--sweep-rows`): tile sizes, K-splits, warps and stages per
   projection and Triton kernel (bench/fp8_gemm_sweep.py), each winner checked like step 1.
3. Per projection and rows: microseconds of bf16 `F.linear`, `torch._scaled_mm`, the weight-only and
   the W8A8 GEMM (default and swept tiles), each in one CUDA graph cycling over enough weight copies
   that L2 holds none, against the weight bytes' floor; per decode rows bucket the fastest becomes
   `auto`'s choice. The swept tiles and the choices go to `DIR/fp8_gemm_configs.json`.
The decode step with FP8 weights against bf16 and its floor: `python -m loraplex.bench.step`.

    PYTHONPATH=protos python3 -m loraplex.bench.fp8_gemm                      # H100/H200, ~2 min
    PYTHONPATH=protos python3 -m loraplex.bench.fp8_gemm --tiny --sweep-budget-s 5   # GPU smoke
    TRITON_INTERPRET=1 PYTHONPATH=protos python3 -m loraplex.bench.fp8_gemm --tiny  # CPU: checks only

Writes fp8_gemm.json and fp8_gemm_configs.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from loraplex.bench import harness as h
from loraplex.bench.fp8_gemm_sweep import GEMMS, copies_of, graph_us, sweep
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels import fp8_gemm_configs
from loraplex.kernels.fp8_gemm_configs import Fp8GemmConfig, Fp8GemmKey, fp8_gemm_config, rows_bucket
from loraplex.kernels.fp8_matmul import dequantize, fp8_linear_mm, quantize_rows
from loraplex.kernels.fp8_weight_gemm import fp8_w8a8_gemm, fp8_weight_gemm

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_PROJECTIONS = {"qkv": (96, 64), "o": (64, 64), "gate_up": (192, 64), "down": (64, 96)}
BLOCK = (128, 128)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.bench.fp8_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes; on the CPU (interpreter) checks only")
    p.add_argument("--rows", default="1,16,32,64,128", help="activation rows timed (comma list)")
    p.add_argument("--sweep-rows", default="64", help="rows swept (comma list; empty: no sweep)")
    p.add_argument("--sweep-budget-s", type=float, default=75.0)
    add_out_argument(p)
    a = p.parse_args(argv)
    a.rows = [int(r) for r in a.rows.split(",") if r]
    a.sweep_rows = [int(r) for r in a.sweep_rows.split(",") if r]
    return a


def block_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 weight and `[ceil(n/128), ceil(k/128)]` scales, as a block-wise checkpoint holds them."""
    n, k = w.shape
    bn, bk = BLOCK
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def operands(n: int, k: int, device: torch.device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) * 0.02
    wq, ws = quantize_rows(w)
    bq, bs = block_scales(w)
    return dict(w=w.to(torch.bfloat16), wq=wq, ws=ws, scale_row=ws.reshape(1, -1).contiguous(), bq=bq, bs=bs)


def check(
    name: str,
    ops: dict,
    rows: int,
    dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
    kernel: str = "weight_only",
) -> bool:
    """A Triton FP8 GEMM (per-channel and block scales; `config` or the table's) vs float32 over the
    dequantized weight (the W8A8 GEMM: over the activations as it quantizes them, too)."""
    n, k = ops["wq"].shape
    x = torch.randn(rows, k, device=ops["wq"].device).to(dtype)
    xq, xs = quantize_rows(x.float())
    x_real = x.float() if kernel == "weight_only" else xq.float() * xs
    ok = True
    for kind, w, s, block in (
        ("channel", ops["wq"], ops["ws"], None),
        ("block", ops["bq"], ops["bs"], BLOCK),
    ):
        deq = dequantize(w, s, block, torch.float32)
        ref = x_real @ deq.T
        bound = (x_real.abs() @ deq.abs().T).clamp(min=1e-6)
        out = GEMMS[kernel](x, w, s, block, None, config)
        err = ((out.float() - ref).abs() / bound).max().item()
        good = out.dtype == dtype and bool(torch.isfinite(out).all()) and err < 2**-7
        ok &= good
        what = f"{kernel} {name} rows {rows} {kind}" + (f" config {tuple(config)}" if config else "")
        print(f"check {what}: rel err {err:.1e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def time_projection(name: str, ops: dict, rows: int, bw: float, swept: dict) -> dict:
    """`swept`: the sweep's best tiles per kernel for this rows bucket and weight (may be empty)."""
    n, k = ops["wq"].shape
    x = torch.randn(rows, k, device=ops["wq"].device, dtype=torch.bfloat16)
    fp8_sets = copies_of((ops["wq"], ops["ws"], ops["scale_row"]))
    row = dict(projection=name, n=n, k=k, rows=rows, config=list(fp8_gemm_config(rows, n, k, x.device)))
    row["bf16_us"] = graph_us(lambda w: F.linear(x, w), copies_of((ops["w"],)))
    row["scaled_mm_us"] = graph_us(lambda wq, ws, sr: fp8_linear_mm(x, wq, sr), fp8_sets)
    row["weight_only_us"] = graph_us(lambda wq, ws, sr: fp8_weight_gemm(x, wq, ws, None), fp8_sets)
    row["weight_only_block_us"] = graph_us(
        lambda bq, bs: fp8_weight_gemm(x, bq, bs, BLOCK), copies_of((ops["bq"], ops["bs"]))
    )
    row["w8a8_us"] = graph_us(lambda wq, ws, sr: fp8_w8a8_gemm(x, wq, ws, None), fp8_sets)
    for kernel, cfg in swept.items():
        row[f"{kernel}_swept_config"] = list(cfg)
        row[f"{kernel}_swept_us"] = graph_us(
            lambda wq, ws, sr, gemm=GEMMS[kernel], cfg=cfg: gemm(x, wq, ws, None, None, cfg), fp8_sets
        )
    times = {
        "scaled_mm": row["scaled_mm_us"],
        **{kernel: min(row[f"{kernel}_us"], row.get(f"{kernel}_swept_us", float("inf"))) for kernel in GEMMS},
    }
    row["fastest"] = min(times, key=times.get)
    row["fastest_us"] = times[row["fastest"]]
    row["fp8_floor_us"] = (n * k + rows * k * 2 + rows * n * 2) / bw * 1e6
    row["bf16_floor_us"] = (n * k * 2 + rows * k * 2 + rows * n * 2) / bw * 1e6
    return row


def _cell(row: dict, key: str, floor: str = "fp8_floor_us") -> str:
    us = row.get(key)
    return f"{us:>7.1f} ({us / row[floor]:.2f})" if us else f"{'-':>13}"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if device.type == "cpu" and not (a.tiny and os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit("needs CUDA; on the CPU: TRITON_INTERPRET=1 ... --tiny (correctness checks only)")
    projections = TINY_PROJECTIONS if a.tiny else PROJECTIONS
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter's bf16 dot is wrong
    ops_by = {name: operands(n, k, device, seed=i) for i, (name, (n, k)) in enumerate(projections.items())}
    ok = all(
        check(name, ops, rows, dtype, None, kernel)
        for name, ops in ops_by.items()
        for rows in a.rows
        for kernel in GEMMS
    )
    if not ok:
        print("FAIL: a Triton FP8 GEMM does not match its reference")
        return 1
    if not cuda:
        print("checks passed (CPU: no timing)")
        return 0
    bw = h.copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for ops in ops_by.values():
        ops["sets"] = [s[:2] for s in copies_of((ops["wq"], ops["ws"]))]
    swept = sweep(projections, ops_by, a.sweep_rows, a.sweep_budget_s) if a.sweep_rows else {}
    names = {shape: name for name, shape in projections.items()}
    for key, cfg in swept.items():
        print(f"  swept {'|'.join(map(str, key))}: {tuple(cfg)}")
        rows = int(key.rows) if key.rows != "prefill" else 128
        if not check(names[(key.n, key.k)], ops_by[names[(key.n, key.k)]], rows, dtype, cfg, key.kernel):
            print("FAIL: a swept config does not match the reference")
            return 1
    kernels = []
    choices: dict[Fp8GemmKey, str] = {}
    print("\nus per projection (x its floor: bf16's bytes for bf16, FP8's for the rest)")
    head = ["proj", "rows", "bf16", "scaled_mm", "wo", "wo swept", "w8a8", "w8a8 swept", "fastest", "vs bf16"]
    print("".join(f"{h:>{w}}" for h, w in zip(head, (8, 5, 13, 13, 13, 13, 13, 13, 18, 8), strict=True)))
    for name, ops in ops_by.items():
        n, k = ops["wq"].shape
        for rows in a.rows:
            bucket = rows_bucket(rows)
            tiles = {
                kernel: swept[key] for kernel in GEMMS if (key := Fp8GemmKey(bucket, n, k, kernel)) in swept
            }
            r = time_projection(name, ops, rows, bw, tiles)
            kernels.append(r)
            if bucket != "prefill" and rows == int(bucket):
                choices[Fp8GemmKey(bucket, n, k, "auto")] = r["fastest"]
            print(
                f"{name:<8}{rows:>5}{_cell(r, 'bf16_us', 'bf16_floor_us')}{_cell(r, 'scaled_mm_us')}"
                f"{_cell(r, 'weight_only_us')}{_cell(r, 'weight_only_swept_us')}{_cell(r, 'w8a8_us')}"
                f"{_cell(r, 'w8a8_swept_us')}{r['fastest']:>11}{r['fastest_us']:>7.1f}"
                f"{r['fastest_us'] / r['bf16_us']:>8.3f}",
                flush=True,
            )
    swept = {**swept, **choices}
    a.out.mkdir(parents=True, exist_ok=True)
    configs_path = a.out / "fp8_gemm_configs.json"
    configs_path.write_text(json.dumps(fp8_gemm_configs.table_json(swept), indent=1))
    print(f"wrote {configs_path} (LORAPLEX_FP8_GEMM_CONFIGS={configs_path})")
    write_json(
        a.out,
        "fp8_gemm",
        dict(
            device=torch.cuda.get_device_name(device),
            copy_bandwidth=bw,
            kernels=kernels,
            swept=fp8_gemm_configs.table_json(swept),
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
