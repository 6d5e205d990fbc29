"""FP8 (E4M3) KV cache on the GPU: the kernels against their torch references, then the decode step.

Checks first (CUDA; any FAIL exits 1 before timing):
  store   the Triton store's bytes against torch's cast of the same float32 values (round to
          nearest even, saturated at +-448), unit and calibrated-looking scales: "0 bytes differ";
  decode  the paged decode kernel over an FP8 cache against the reference that dequantizes on
          gather (fp32 math), bf16 queries, Llama-3.1-8B heads: rel err < 2e-2;
  prefill the same for the paged prefill kernel (chunks after cached pages).
Then the batch-64 ctx-1024 decode step of a random Llama-3.1-8B-shape model (CUDA graphs, CUDA
events), for bf16 weights + bf16 KV | bf16 + fp8 KV | fp8 weights + bf16 KV | fp8 + fp8 KV, each
against its memory floor (weights as stored + the batch's KV, over the copy bandwidth measured in
the same run) and against the bf16 step (issue 35: fp8 weights + fp8 KV <= 0.60x bf16). The fp8-KV
step's logits are compared with the same weights' bf16-KV step (top-1 agreement; report only).

    PYTHONPATH=protos python3 -m loraplex.bench.fp8_kv                        # H100/H200, ~2 min
    PYTHONPATH=protos python3 -m loraplex.bench.fp8_kv --tiny --device cpu    # smoke (no kernels)

Writes fp8_kv.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time

import torch

from loraplex.bench.fp8_step import copy_bandwidth, weight_bytes
from loraplex.bench.mixed_step import Layout, fill_contexts, make_step, time_step
from loraplex.bench.random_runner import TINY, build_runner
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.kernels.attention_kv_store import FP8_E4M3, quantize_fp8_ref, store_kv, store_kv_ref
from loraplex.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref
from loraplex.services.inference.engine.kv_cache import kv_bytes_per_token

log = logging.getLogger("loraplex.bench.fp8_kv")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SCALES = ((1.0, 1.0), (0.05, 3.0))  # (k, v): the default, and calibrated-looking scales
TOL = 2e-2  # bf16 queries and outputs, as bench/attention_kernels.py


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.bench.fp8_kv", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model shape (CPU smoke check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None, help="decode batch (default 64; --tiny 4)")
    p.add_argument("--ctx", type=int, default=None, help="context per sequence (default 1024; --tiny 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 50; --tiny 3)")
    p.add_argument("--budget-s", type=float, default=170.0, help="skip the remaining step cases after this")
    add_out_argument(p)
    a = p.parse_args(argv)
    a.batch = a.batch or (4 if a.tiny else 64)
    a.ctx = a.ctx or (32 if a.tiny else 1024)
    a.repeats = a.repeats or (3 if a.tiny else 50)
    return a


def _scales(k: float, v: float, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(k scale, v scale, k inverse, v inverse): one-element float32 tensors, as KVCacheScales has them."""
    ks, vs = torch.tensor([k], device=dev), torch.tensor([v], device=dev)
    return ks, vs, 1.0 / ks, 1.0 / vs


def kv_rows(n: int, scale: float, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """bf16 K or V rows `[n, KV_HEADS, HEAD_DIM]` that exercise the rounding: real-model magnitudes
    (0.01 .. 20), exact ties between E4M3 neighbours and one bf16 step either side, values past 448."""
    shape = (n, KV_HEADS, HEAD_DIM)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_E4M3).float()
    grid = grid[grid.isfinite()].unique()
    mids = ((grid[1:] + grid[:-1]) / 2).to(torch.bfloat16)  # exact in bf16 (4 significant bits)
    bits = mids.view(torch.int16)
    pool = torch.cat([mids, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16)]).float()
    pool = torch.cat([pool, torch.tensor([600.0, -1e4])]).to(dev)
    pick = pool[torch.randint(0, pool.numel(), shape, device=dev, generator=gen)]
    mags = torch.tensor([0.01, 1.0, 20.0], device=dev)[torch.randint(0, 3, shape, device=dev, generator=gen)]
    wide = torch.randn(shape, device=dev, generator=gen) * mags
    x = torch.where(torch.rand(shape, device=dev, generator=gen) < 0.3, pick, wide) * scale
    return x.to(torch.bfloat16)


def check_store(dev: torch.device, gen: torch.Generator) -> list[dict]:
    rows = []
    for k_scale, v_scale in SCALES:
        _, _, k_inv, v_inv = _scales(k_scale, v_scale, dev)
        base = quantize_fp8_ref(torch.randn(2, 64, PAGE, KV_HEADS, HEAD_DIM, device=dev, generator=gen), 1.0)
        caches = [base[0].clone(), base[1].clone(), base[0].clone(), base[1].clone()]
        k, v = kv_rows(600, k_scale, dev, gen), kv_rows(600, v_scale, dev, gen)
        slots = torch.randperm(64 * PAGE, device=dev, generator=gen)[:600]
        slots[::7] = -1  # CUDA-graph padding rows: skipped
        store_kv(k, v, caches[0], caches[1], slots, k_inv, v_inv)
        store_kv_ref(k, v, caches[2], caches[3], slots, k_inv, v_inv)
        differ = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            for a, b in zip(caches[:2], caches[2:], strict=True)
        )
        written = int((caches[0].view(torch.uint8) != base[0].view(torch.uint8)).sum())
        ok = differ == 0 and written > 0
        rows.append(dict(check=f"store scales {k_scale}/{v_scale}", bytes_differ=differ, ok=ok))
        print(f"store   scales {k_scale}/{v_scale}: {differ} bytes differ {'ok' if ok else 'FAIL'}")
    return rows


def paged_fp8(lens: list[int], k_scale: float, v_scale: float, dev: torch.device, gen: torch.Generator):
    """FP8 caches holding sequences of `lens` tokens over shuffled pages, and their block tables."""
    per = [-(-n // PAGE) for n in lens]
    pages = sum(per) + 1
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    k = quantize_fp8_ref(torch.randn(shape, device=dev, generator=gen) * 2 * k_scale, 1.0 / k_scale)
    v = quantize_fp8_ref(torch.randn(shape, device=dev, generator=gen) * v_scale, 1.0 / v_scale)
    order = torch.randperm(pages, device=dev, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(per):
        tables[b, :n] = order[used : used + n]
        used += n
    return k, v, tables


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_attention(dev: torch.device, gen: torch.Generator) -> list[dict]:
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention

    rows = []
    for k_scale, v_scale in SCALES:
        ks, vs, _, _ = _scales(k_scale, v_scale, dev)
        lens = [1024, 1, 700, 0, 333, 1024, 17, 512]
        k, v, tables = paged_fp8(lens, k_scale, v_scale, dev, gen)
        q = torch.randn(len(lens), HEADS, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        args = (q, k, v, tables, ctx, HEAD_DIM**-0.5)
        out = paged_decode_attention(*args, k_scale=ks, v_scale=vs)
        err = _rel(out, paged_decode_attention_ref(*args, k_scale=ks, v_scale=vs))
        ok = bool(torch.isfinite(out).all()) and err < TOL
        rows.append(dict(check=f"decode scales {k_scale}/{v_scale}", rel_err=err, ok=ok))
        print(f"decode  scales {k_scale}/{v_scale}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        kv_lens, q_lens = [300, 1024, 64], [300, 200, 1]  # a fresh prompt, a chunk after cached pages
        k, v, tables = paged_fp8(kv_lens, k_scale, v_scale, dev, gen)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        q = torch.randn(int(cu[-1]), HEADS, HEAD_DIM, device=dev, generator=gen).to(torch.bfloat16)
        kv = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        args = (q, k, v, tables, cu, kv, HEAD_DIM**-0.5)
        out = paged_prefill_attention(*args, max(q_lens), k_scale=ks, v_scale=vs)
        err = _rel(out, paged_prefill_attention_ref(*args, k_scale=ks, v_scale=vs))
        ok = bool(torch.isfinite(out).all()) and err < TOL
        rows.append(dict(check=f"prefill scales {k_scale}/{v_scale}", rel_err=err, ok=ok))
        print(f"prefill scales {k_scale}/{v_scale}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return rows


def decode_case(a, name: str, device, fp8_weights: bool, kv_dtype, bw) -> tuple[dict, torch.Tensor]:
    """One decode step's time, floor and logits (a freshly built runner; same random weights per seed)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = Layout(a.ctx, a.batch)
    runner = build_runner(
        TINY if a.tiny else LLAMA_8B,
        dtype=dtype,
        device=device,
        slots=0,
        rank=16,
        max_num_tokens=max(a.ctx, 2 * a.batch),
        max_num_seqs=a.batch,
        context_length=a.ctx + 32,
        page_size=PAGE,
        num_blocks=layout.num_blocks,
        fp8=fp8_weights,
        kv_dtype=kv_dtype,
    )
    fill_contexts(runner, layout, a.batch, a.ctx, 0)
    if device.type == "cuda":
        runner.capture_cuda_graphs(a.batch)
    step = make_step(layout, a.batch, 0, 0, a.ctx, 0)
    logits = runner.forward(step).float().cpu()
    time_step(runner, step, 2)  # warm
    t = time_step(runner, step, a.repeats)
    ms = t["gpu_ms"] if t["gpu_ms"] is not None else t["step_ms"]
    kv = kv_bytes_per_token(runner.config, runner.kv_cache.dtype) * a.batch * (a.ctx + 1)
    weights = weight_bytes(runner.model)
    row = dict(
        case=name,
        ms=ms,
        weight_gb=weights / 1e9,
        kv_gb=kv / 1e9,
        read_gb=(weights + kv) / 1e9,
        floor_ms=(weights + kv) / bw * 1e3 if bw else None,
    )
    row["x_floor"] = ms / row["floor_ms"] if row["floor_ms"] else None
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, logits


def agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    return dict(
        top1_agreement=(ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
        logits_rel_err=_rel(got, ref),
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse(argv)
    started = time.perf_counter()
    device = torch.device(a.device)
    checks: list[dict] = []
    if device.type == "cuda":
        gen = torch.Generator(device=device).manual_seed(0)
        checks = check_store(device, gen) + check_attention(device, gen)
        if not all(c["ok"] for c in checks):
            print("FAIL: the FP8 KV kernels disagree with their torch references; not timing")
            write_json(a.out, "fp8_kv", dict(checks=checks, steps=[]))
            return 1
    else:
        print(
            "kernel checks skipped: no CUDA (interpreter checks: tests/integration/test_attention_kernels.py)"
        )
    bw = copy_bandwidth(device)
    base = "bf16" if device.type == "cuda" else "fp32"
    cases = [
        (f"{base} weights, {base} KV", False, None),
        (f"{base} weights, fp8 KV", False, FP8_E4M3),
        (f"fp8 weights, {base} KV", True, None),
        ("fp8 weights, fp8 KV", True, FP8_E4M3),
    ]
    rows, logits = [], []
    for name, fp8_weights, kv_dtype in cases:
        if time.perf_counter() - started > a.budget_s:
            print(f"{name}: skipped (--budget-s {a.budget_s:.0f} spent)")
            continue
        row, out = decode_case(a, name, device, fp8_weights, kv_dtype, bw)
        row["fp8_weights"], row["fp8_kv"] = fp8_weights, kv_dtype is not None
        rows.append(row)
        logits.append(out)
    first = rows[0]["ms"] if rows and rows[0]["case"] == cases[0][0] else None
    for r in rows:
        r["x_" + base] = r["ms"] / first if first else None
    quality = {}
    by_case = {r["case"]: out for r, out in zip(rows, logits, strict=True)}
    for weights in (base, "fp8"):  # the KV cache's cost alone: same weights, fp8 KV against float KV
        ref, got = by_case.get(f"{weights} weights, {base} KV"), by_case.get(f"{weights} weights, fp8 KV")
        if ref is not None and got is not None:
            quality[f"{weights} weights: fp8 KV vs {base} KV"] = agreement(ref, got)
    print(f"\ndecode step, batch {a.batch}, ctx {a.ctx}, on {device}")
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(
        f"{'case':<28}{'ms':>9}{'weights GB':>12}{'KV GB':>8}{'floor ms':>10}{'x floor':>9}{'x ' + base:>9}"
    )
    for r in rows:
        floor = f"{r['floor_ms']:>10.2f}{r['x_floor']:>9.2f}" if r["floor_ms"] else f"{'-':>10}{'-':>9}"
        ratio = f"{r['x_' + base]:>9.3f}" if r["x_" + base] else f"{'-':>9}"
        print(f"{r['case']:<28}{r['ms']:>9.3f}{r['weight_gb']:>12.3f}{r['kv_gb']:>8.3f}{floor}{ratio}")
    last = next((r for r in rows if r["case"] == "fp8 weights, fp8 KV"), None)
    if last and last["x_" + base]:
        verdict = "meets" if last["x_" + base] <= 0.60 else "misses"
        print(f"fp8 weights + fp8 KV / {base}: {last['x_' + base]:.3f} ({verdict} issue 35's <= 0.60)")
    for k, q in quality.items():
        print(f"{k}: top-1 agreement {q['top1_agreement']:.3f}, logits rel err {q['logits_rel_err']:.2e}")
    write_json(
        a.out,
        "fp8_kv",
        dict(
            device=str(torch.cuda.get_device_name(device) if device.type == "cuda" else device),
            batch=a.batch,
            ctx=a.ctx,
            copy_bandwidth=bw,
            checks=checks,
            steps=rows,
            quality=quality,
            seconds=time.perf_counter() - started,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
