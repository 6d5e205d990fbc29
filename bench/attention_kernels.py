"""The kernels suite's attention part (bench/kernels.py): the paged decode kernel over bf16 and FP8
caches and the prefill kernel at Llama-3.1-8B's heads, each checked against its torch reference, then
timed as replays of a graph calling it once per layer over distinct per-layer caches."""

from __future__ import annotations

import statistics

import torch

from loraplex.bench.graph_timing import capture, replay_ms
from loraplex.bench.lora_layer import DEVICE

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DT, FP8 = torch.bfloat16, torch.float8_e4m3fn


def paged_kv(batch: int, ctx: int, layers: int, gen: torch.Generator):
    """Per-layer bf16 K/V caches, each sequence's pages shuffled over the pool, and the block tables."""
    pages = -(-ctx // PAGE)
    shape = (batch * pages, PAGE, KV_HEADS, HEAD_DIM)
    caches = [
        tuple(torch.randn(shape, device=DEVICE, dtype=DT, generator=gen) for _ in range(2))
        for _ in range(layers)
    ]
    perm = torch.randperm(batch * pages, device=DEVICE, generator=gen).to(torch.int32)
    return caches, perm.view(batch, pages)


def as_fp8(caches: list) -> list:
    one = torch.ones(1, device=DEVICE)
    return [(k.to(FP8), v.to(FP8), one, one) for k, v in caches]


def kv_kwargs(cache: tuple) -> tuple[tuple, dict]:
    return cache[:2], ({"k_scale": cache[2], "v_scale": cache[3]} if len(cache) == 4 else {})


def per_call_us(fn, layers: int) -> float:
    graph = capture(lambda: [fn(i) for i in range(layers)])
    return statistics.median(t / layers for t in replay_ms(graph, 20)) * 1e3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def attention_checks(gen: torch.Generator) -> dict[str, float]:
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention
    from loraplex.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref

    errs = {}
    lens = torch.randint(1, 1500, (16,), generator=torch.Generator().manual_seed(0))
    lens[0], lens[1] = 1, 0
    caches, tables = paged_kv(16, 1500, 1, gen)
    ctx, scale = lens.to(DEVICE, torch.int32), HEAD_DIM**-0.5
    q = torch.randn(16, HEADS, HEAD_DIM, device=DEVICE, dtype=DT, generator=gen)
    for name, cache in (("decode bf16", caches[0]), ("decode fp8", as_fp8(caches)[0])):
        kv, kw = kv_kwargs(cache)
        out = paged_decode_attention(q, *kv, tables, ctx, scale, **kw)
        errs[name] = rel_err(out, paged_decode_attention_ref(q, *kv, tables, ctx, scale, **kw))
    caches, tables = paged_kv(3, 1000, 1, gen)
    cu = torch.tensor([0, 300, 812, 813], device=DEVICE, dtype=torch.int32)
    kv_lens = torch.tensor([300, 1000, 77], device=DEVICE, dtype=torch.int32)
    q = torch.randn(813, HEADS, HEAD_DIM, device=DEVICE, dtype=DT, generator=gen)
    out = paged_prefill_attention(q, *caches[0], tables, cu, kv_lens, scale, 512)
    errs["prefill bf16"] = rel_err(
        out, paged_prefill_attention_ref(q, *caches[0], tables, cu, kv_lens, scale)
    )
    return errs


def attention_rows(bw: float, rate: float, gen: torch.Generator, tiny: bool) -> list[dict]:
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention

    rows, scale = [], HEAD_DIM**-0.5
    for batch in (8,) if tiny else (1, 16, 64, 256):
        ctx_len = 1024
        bf16_bytes = batch * ctx_len * KV_HEADS * HEAD_DIM * 2 * 2
        layers = max(2, min(32, (2 << 30) // bf16_bytes))
        bf16, tables = paged_kv(batch, ctx_len, layers, gen)
        ctx = torch.full((batch,), ctx_len, device=DEVICE, dtype=torch.int32)
        q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=DT, generator=gen)
        outs = [torch.empty_like(q) for _ in range(layers)]
        for kind, caches, nbytes in (("bf16", bf16, bf16_bytes), ("fp8", as_fp8(bf16), bf16_bytes / 2)):

            def call(i, caches=caches, q=q, tables=tables, ctx=ctx, outs=outs):
                kv, kw = kv_kwargs(caches[i])
                paged_decode_attention(q, *kv, tables, ctx, scale, out=outs[i], **kw)

            rows.append(
                dict(
                    kernel=f"decode {kind} KV, batch {batch}, ctx {ctx_len}",
                    us=per_call_us(call, layers),
                    floor_us=nbytes / bw * 1e6,
                )
            )
        del bf16
        torch.cuda.empty_cache()
    for name, batch, q_len, kv_len in (("8x1024", 8, 1024, 1024), ("8x512 after 1024", 8, 512, 1536)):
        if tiny and kv_len > 1024:
            continue
        caches, tables = paged_kv(batch, kv_len, 4, gen)
        cu = torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * q_len
        kv = torch.full((batch,), kv_len, device=DEVICE, dtype=torch.int32)
        q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=DEVICE, dtype=DT, generator=gen)
        out = torch.empty_like(q)
        flops = 4 * batch * HEADS * HEAD_DIM * sum(kv_len - q_len + i + 1 for i in range(q_len))

        def call(i, a=(q, caches, tables, cu, kv, q_len, out)):
            paged_prefill_attention(a[0], *a[1][i], a[2], a[3], a[4], scale, a[5], out=a[6])

        rows.append(dict(kernel=f"prefill {name}", us=per_call_us(call, 4), floor_us=flops / rate * 1e6))
        del caches
        torch.cuda.empty_cache()
    for r in rows:
        r["x_floor"] = r["us"] / r["floor_us"]
    return rows
