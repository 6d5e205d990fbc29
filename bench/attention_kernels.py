"""GPU check and timing of the paged attention kernels at Llama-3.1-8B shapes.

Run on the device from the repo root:
`PYTHONPATH=protos python3 -m loraplex.bench.attention_kernels [--out DIR]`.
bf16 results are checked against the torch references first (the CPU interpreter cannot check
bf16), then each kernel configuration is timed as replays of a CUDA graph that calls it once per
layer over distinct per-layer caches (so the L2 does not hold the KV and launch gaps shrink),
against the floor: KV bytes over the copy bandwidth measured here (decode), FLOPs over the
measured bf16 matmul rate (prefill). Decode runs over a bf16 and an FP8 (E4M3) cache, with the
default split count and the configs' own; `--decode-only` skips prefill. Prints a table; writes
attention_kernels.json to --out DIR.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch
import triton

from loraplex.bench.graph_timing import capture, replay_ms
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.attention_decode import paged_decode_attention
from loraplex.kernels.attention_prefill import paged_prefill_attention
from loraplex.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
DEV = torch.device("cuda")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(1 << 30, device=DEV, dtype=DT)  # 2 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=50, rep=300, return_mode="median")
    return 2 * (1 << 30) * 2 / (ms * 1e-3)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn(8192, 8192, device=DEV, dtype=DT)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def paged_kv(batch: int, ctx: int, layers: int, gen: torch.Generator):
    """Per-layer K/V caches with each sequence's pages shuffled over the pool."""
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq
    caches = [
        (
            torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen),
            torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen),
        )
        for _ in range(layers)
    ]
    perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32)
    return caches, perm.view(batch, pages_per_seq)


def graph_time_per_call(fn_per_layer, layers: int, reps: int = 20) -> float:
    """Median ms of one call, timed as replays of a graph holding `layers` calls."""
    graph = capture(lambda: [fn_per_layer(i) for i in range(layers)])
    return statistics.median(t / layers for t in replay_ms(graph, reps))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def as_fp8(caches: list) -> list:
    """The caches in E4M3 with unit scales (their bf16 values are within E4M3's range)."""
    one = torch.ones(1, device=DEV)
    return [(k.to(FP8), v.to(FP8), one, one) for k, v in caches]


def decode_args(cache: tuple) -> tuple[tuple, dict]:
    """(k_cache, v_cache) positional, the FP8 scales (when present) as keywords."""
    return cache[:2], ({"k_scale": cache[2], "v_scale": cache[3]} if len(cache) == 4 else {})


def check_decode(gen: torch.Generator, fp8: bool, **config) -> float:
    lens = torch.randint(1, 1500, (16,), generator=torch.Generator().manual_seed(0))
    lens[0], lens[1] = 1, 0
    caches, tables = paged_kv(16, 1500, 1, gen)
    kv, scales = decode_args(as_fp8(caches)[0] if fp8 else caches[0])
    q = torch.randn(16, HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen)
    ctx = lens.to(DEV, torch.int32)
    out = paged_decode_attention(q, *kv, tables, ctx, HEAD_DIM**-0.5, **scales, **config)
    ref = paged_decode_attention_ref(q, *kv, tables, ctx, HEAD_DIM**-0.5, **scales)
    return rel_err(out, ref)


def check_prefill(gen: torch.Generator) -> float:
    kv_lens, q_lens = [300, 1000, 77], [300, 512, 1]
    caches, tables = paged_kv(3, 1000, 1, gen)
    cu = torch.tensor([0, 300, 812, 813], device=DEV, dtype=torch.int32)
    kv = torch.tensor(kv_lens, device=DEV, dtype=torch.int32)
    q = torch.randn(813, HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen)
    out = paged_prefill_attention(q, *caches[0], tables, cu, kv, HEAD_DIM**-0.5, max(q_lens))
    ref = paged_prefill_attention_ref(q, *caches[0], tables, cu, kv, HEAD_DIM**-0.5)
    return rel_err(out, ref)


DECODE_CONFIGS = [  # block_n (None: the default for the batch and cache), num_warps, num_stages, splits
    (None, 4, None, None),
    (64, 4, 2, None),
    (32, 4, 2, None),
    (128, 4, 2, None),
    (64, 8, 2, None),
    (64, 4, 3, None),
    (128, 4, 3, None),
    (64, 4, 2, 2),
    (128, 4, 3, 2),
    (128, 4, 4, None),
    (256, 4, 3, None),
    (256, 8, 3, None),
]
# FP8 caches also time each config with the dots in bf16 (the default is fp16).
BF16_DOT = {"f16_dot": False}
FP8 = torch.float8_e4m3fn
PREFILL_CONFIGS = [  # block_m, block_n, num_warps, num_stages
    (64, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (64, 32, 4, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 2),
]


def bench_decode(bw: float, gen: torch.Generator, batches: tuple[int, ...] = (1, 16, 64, 256)) -> list[dict]:
    rows = []
    for batch in batches:
        ctx_len = 1024
        bf16_bytes = batch * ctx_len * KV_HEADS * HEAD_DIM * 2 * 2
        layers = max(2, min(32, (2 << 30) // bf16_bytes))
        bf16_caches, tables = paged_kv(batch, ctx_len, layers, gen)
        ctx = torch.full((batch,), ctx_len, device=DEV, dtype=torch.int32)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen)
        outs = [torch.empty_like(q) for _ in range(layers)]
        fp8_caches = as_fp8(bf16_caches)
        kinds = (("bf16", bf16_caches, {}), ("fp8", fp8_caches, {}), ("fp8 bf16-dot", fp8_caches, BF16_DOT))
        for kv_dtype, caches, extra in kinds:
            floor_us = bf16_bytes / (2 if caches is fp8_caches else 1) / bw * 1e6
            for block_n, warps, stages, splits in DECODE_CONFIGS:
                config = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits, **extra)

                def call(i, config=config, q=q, caches=caches, tables=tables, ctx=ctx, outs=outs):
                    kv, scales = decode_args(caches[i])
                    paged_decode_attention(
                        q, *kv, tables, ctx, HEAD_DIM**-0.5, out=outs[i], **scales, **config
                    )

                us = graph_time_per_call(call, layers) * 1e3
                rows.append(
                    dict(
                        kind="decode",
                        kv=kv_dtype,
                        batch=batch,
                        ctx=ctx_len,
                        block_n=block_n or "auto",
                        warps=warps,
                        stages=stages or "auto",
                        splits=splits or "auto",
                        us=us,
                        floor_us=floor_us,
                        ratio=us / floor_us,
                    )
                )
            del caches
        del bf16_caches, fp8_caches
        torch.cuda.empty_cache()
    return rows


def bench_prefill(rate: float, gen: torch.Generator) -> list[dict]:
    rows = []
    for name, batch, q_len, kv_len in (("8x1024", 8, 1024, 1024), ("8x512 after 1024", 8, 512, 1536)):
        layers = 4
        caches, tables = paged_kv(batch, kv_len, layers, gen)
        cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * q_len
        kv = torch.full((batch,), kv_len, device=DEV, dtype=torch.int32)
        q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=DEV, dtype=DT, generator=gen)
        out = torch.empty_like(q)
        prefix = kv_len - q_len
        flops = 4 * batch * HEADS * HEAD_DIM * sum(prefix + i + 1 for i in range(q_len))
        floor_us = flops / rate * 1e6
        for bm, bn, warps, stages in PREFILL_CONFIGS:

            def call(i, bm=bm, bn=bn, w=warps, s=stages, args=(q, caches, tables, cu, kv, q_len, out)):
                q, caches, tables, cu, kv, q_len, out = args
                paged_prefill_attention(
                    q,
                    *caches[i],
                    tables,
                    cu,
                    kv,
                    HEAD_DIM**-0.5,
                    q_len,
                    out=out,
                    block_m=bm,
                    block_n=bn,
                    num_warps=w,
                    num_stages=s,
                )

            us = graph_time_per_call(call, layers) * 1e3
            rows.append(
                dict(
                    kind="prefill",
                    case=name,
                    block_m=bm,
                    block_n=bn,
                    warps=warps,
                    stages=stages,
                    us=us,
                    floor_us=floor_us,
                    ratio=us / floor_us,
                )
            )
        if prefix == 0:  # torch's flash SDPA on the same tokens laid out dense, for comparison
            qd = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2)
            kd = torch.randn(batch, HEADS, kv_len, HEAD_DIM, device=DEV, dtype=DT, generator=gen)
            vd = torch.randn_like(kd)

            def sdpa(i, qkv=(qd, kd, vd)):
                torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)

            us = graph_time_per_call(sdpa, layers) * 1e3
            rows.append(
                dict(
                    kind="prefill",
                    case=name + " torch SDPA (dense)",
                    us=us,
                    floor_us=floor_us,
                    ratio=us / floor_us,
                )
            )
        del caches
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill kernel")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batch sizes (comma list)")
    add_out_argument(parser)
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    errs = {"decode_bf16": check_decode(gen, False), "prefill_bf16": check_prefill(gen)}
    for block_n, warps, stages, splits in DECODE_CONFIGS:  # every timed FP8 config, checked first
        config = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
        errs[f"decode_fp8 {block_n}/{warps}/{stages}/{splits}"] = check_decode(gen, True, **config)
    errs["decode_fp8 bf16-dot"] = check_decode(gen, True, **BF16_DOT)
    ok = all(e < 2e-2 for e in errs.values())
    print("check vs torch reference:", {k: f"{v:.2e}" for k, v in errs.items()}, "ok" if ok else "FAIL")
    if not ok:
        return 1
    batches = tuple(int(b) for b in args.batches.split(","))
    rows = bench_decode(bw, gen, batches) + ([] if args.decode_only else bench_prefill(rate, gen))
    print("decode config: block_n/warps/stages/splits; prefill: block_m/block_n/warps/stages")
    print(f"{'kernel':<34}{'config':<18}{'us':>9}{'floor us':>10}{'x floor':>9}")
    for r in rows:
        decode = r["kind"] == "decode"
        label = f"decode {r['kv']} B={r['batch']} ctx={r['ctx']}" if decode else f"prefill {r['case']}"
        cfg = "/".join(str(r[k]) for k in ("block_m", "block_n", "warps", "stages", "splits") if k in r)
        print(f"{label:<34}{cfg:<18}{r['us']:>9.1f}{r['floor_us']:>10.1f}{r['ratio']:>9.2f}")
    result = dict(device=torch.cuda.get_device_name(), copy_bw=bw, matmul_rate=rate, errors=errs, rows=rows)
    write_json(args.out, "attention_kernels", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
