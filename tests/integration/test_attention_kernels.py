"""Paged attention kernels (kernels/attention_*.py) against their torch references.

The Triton kernels run on the CPU under TRITON_INTERPRET=1. That variable is read when triton is
imported, and pytest imports every test module into one process, so the interpreter checks run
in a fresh subprocess (`python -m tests.integration.test_attention_kernels`) with the variable set. The
references are themselves checked against torch's scaled_dot_product_attention here.
bf16 is checked on the GPU (bench/kernels.py): the interpreter gets bf16 math wrong.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from loraplex.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref
from tests.support.child import assert_interpreter_checks_pass


class PagedCase(NamedTuple):
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence [len, kv_heads, head_dim], for the SDPA check
    dense_v: list[torch.Tensor]


def make_paged_case(
    lens: list[int], kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, seed: int
) -> PagedCase:
    """K/V for sequences of `lens` tokens scattered over shuffled pages.

    Every byte a kernel must not read is NaN: free pages, the tail of each last page, and the
    page that unused block-table entries point at. Reading any of it poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_seq) + 3
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0: the poisoned target
    max_pages = max(pages_per_seq + [1]) + 2
    tables = torch.zeros((len(lens), max_pages), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for b, n in enumerate(lens):
        pages = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        tables[b, : len(pages)] = pages.to(torch.int32)
        k = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
        for i in range(n):
            k_cache[pages[i // page_size], i % page_size] = k[i]
            v_cache[pages[i // page_size], i % page_size] = v[i]
        dense_k.append(k)
        dense_v.append(v)
    return PagedCase(k_cache, v_cache, tables, dense_k, dense_v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[M, H, D]` as the last M positions of k/v `[N, KVH, D]`, via SDPA (float64)."""
    group = q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)
    kh = k.double().repeat_interleave(group, 1).transpose(0, 1)
    vh = v.double().repeat_interleave(group, 1).transpose(0, 1)
    m, n = q.shape[0], k.shape[0]
    mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)


def test_decode_reference_matches_sdpa() -> None:
    lens = [1, 17, 40, 0]
    case = make_paged_case(lens, kv_heads=2, head_dim=32, page_size=8, dtype=torch.float32, seed=1)
    q = torch.randn(len(lens), 8, 32)
    out = paged_decode_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, torch.tensor(lens), 0.2
    )
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        ref = _sdpa(q[b : b + 1], case.dense_k[b], case.dense_v[b], 0.2)[0]
        assert rel_err(out[b], ref) < 1e-5


def test_prefill_reference_matches_sdpa() -> None:
    kv_lens, q_lens = [9, 33], [9, 12]  # second: a chunk after 21 earlier tokens
    case = make_paged_case(kv_lens, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32, seed=2)
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 16)
    out = paged_prefill_attention_ref(
        q, case.k_cache, case.v_cache, case.block_tables, cu, torch.tensor(kv_lens), 0.25
    )
    for b in range(2):
        ref = _sdpa(q[cu[b] : cu[b + 1]], case.dense_k[b], case.dense_v[b], 0.25)
        assert rel_err(out[cu[b] : cu[b + 1]], ref) < 1e-5


def test_cuda_graph_batch_ladder() -> None:
    from loraplex.services.inference.engine.cuda_graph import batch_ladder

    assert batch_ladder(1) == [1]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    ladder = batch_ladder(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256 and all(b % 16 == 0 for b in ladder[4:])


def test_cuda_graph_lora_tiers() -> None:
    """A decode step replays (its batch bucket, LoRA tier): 0 without adapters, 1 up to MANY_ADAPTERS
    distinct adapters (segment expand), 2 above (per-token expand); no LoRA backend: only tier 0."""
    from loraplex.kernels.lora_configs import MANY_ADAPTERS
    from loraplex.services.inference.engine.cuda_graph import DecodeGraphs, batch_ladder

    graphs = DecodeGraphs.__new__(DecodeGraphs)  # key() needs only the ladder and the backend (no GPU)
    graphs.ladder, graphs.lora = batch_ladder(64), object()
    assert graphs.key(64, 0) == (64, 0, 0)
    assert graphs.key(3, 2) == (4, 1, 0)
    assert graphs.key(64, MANY_ADAPTERS) == (64, 1, 0)
    assert graphs.key(20, MANY_ADAPTERS + 1) == (32, 2, 0)  # tier 2 exists only above MANY_ADAPTERS tokens
    assert graphs.key(65, 1) is None
    # a step holding DoRA / vocabulary-part adapters replays the kinds variant (engine/cuda_graph.py)
    assert graphs.key(3, 2, kinds=True) == (4, 1, 1)
    graphs.lora = None
    assert graphs.key(8, 0) == (8, 0, 0) and graphs.key(8, 1) is None


def test_kernels_under_triton_interpreter() -> None:
    assert_interpreter_checks_pass("tests.integration.test_attention_kernels")


# ---- run in the subprocess, with TRITON_INTERPRET=1 ----

DECODE_CASES = [
    # lens, heads, kv_heads, head_dim, page_size, num_splits, block_n
    ([1, 37, 130, 0], 8, 2, 64, 16, None, 32),
    ([5, 64], 4, 4, 32, 8, 3, 16),
    ([70], 4, 1, 80, 16, 1, 32),
]
PREFILL_CASES = [
    # kv_lens, q_lens, heads, kv_heads, head_dim, page_size, block_m, block_n
    ([5, 70, 40], [5, 33, 1], 8, 2, 64, 16, 16, 16),
    ([48], [48], 4, 4, 32, 8, 32, 16),
    ([20, 9], [3, 9], 4, 1, 80, 4, 16, 32),
]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}


def _interpreter_checks() -> int:
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention

    failures = 0
    for dtype in (torch.float32, torch.float16):
        for i, (lens, heads, kvh, dim, page, splits, bn) in enumerate(DECODE_CASES):
            case = make_paged_case(lens, kvh, dim, page, dtype, seed=10 + i)
            q = torch.randn(len(lens), heads, dim).to(dtype)
            ctx = torch.tensor(lens, dtype=torch.int32)
            scale = dim**-0.5
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(
                q,
                case.k_cache,
                case.v_cache,
                case.block_tables,
                ctx,
                scale,
                out=out,
                num_splits=splits,
                block_n=bn,
            )
            ref = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, ctx, scale)
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and err < TOL[dtype]
            failures += not ok
            print(f"decode  {dtype} case {i}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        for i, (kv_lens, q_lens, heads, kvh, dim, page, bm, bn) in enumerate(PREFILL_CASES):
            case = make_paged_case(kv_lens, kvh, dim, page, dtype, seed=20 + i)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            q = torch.randn(int(cu[-1]), heads, dim).to(dtype)
            kv = torch.tensor(kv_lens, dtype=torch.int32)
            scale = dim**-0.5
            out = torch.full_like(q, float("nan"))
            paged_prefill_attention(
                q,
                case.k_cache,
                case.v_cache,
                case.block_tables,
                cu,
                kv,
                scale,
                max(q_lens),
                out=out,
                block_m=bm,
                block_n=bn,
            )
            ref = paged_prefill_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, cu, kv, scale)
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and err < TOL[dtype]
            failures += not ok
            print(f"prefill {dtype} case {i}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        failures += _check_windows_and_softcap(dtype)
        failures += _check_store(dtype) + _check_engine_backend(dtype) + _check_fused_ops(dtype)
        failures += (
            _check_fp8_store(dtype) + _check_fp8_attention(dtype) + _check_engine_backend(dtype, (0.05, 3.0))
        )
    cases = 2 * (len(DECODE_CASES) + len(PREFILL_CASES) + 6 + 2 * len(WINDOW_CASES) + 7)
    print(f"checked {cases} cases, {failures} failed")
    return failures


# window, softcap: sliding windows shorter than the contexts (a chunk's rows start inside and
# outside the window, some splits/tiles read nothing), soft-capping (Gemma 2) with and without one.
WINDOW_CASES = [(7, None), (20, 3.0), (None, 2.0), (1, None)]


def _check_windows_and_softcap(dtype: torch.dtype) -> int:
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention

    failures = 0
    for i, (window, cap) in enumerate(WINDOW_CASES):
        lens = [1, 37, 70, 0]
        case = make_paged_case(lens, 2, 32, 8, dtype, seed=40 + i)
        q = torch.randn(len(lens), 8, 32).to(dtype) * 3
        ctx = torch.tensor(lens, dtype=torch.int32)
        out = torch.full_like(q, float("nan"))
        opts = dict(window=window, softcap=cap)
        paged_decode_attention(
            q, case.k_cache, case.v_cache, case.block_tables, ctx, 0.2, out=out, block_n=16, **opts
        )
        ref = paged_decode_attention_ref(q, case.k_cache, case.v_cache, case.block_tables, ctx, 0.2, **opts)
        err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and err < TOL[dtype]
        failures += not ok
        print(f"decode  {dtype} window {window} softcap {cap}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
        kv_lens, q_lens = [5, 70, 40], [5, 33, 1]
        case = make_paged_case(kv_lens, 2, 32, 8, dtype, seed=50 + i)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 8, 32, generator=torch.Generator().manual_seed(90 + i)).to(dtype) * 3
        kv = torch.tensor(kv_lens, dtype=torch.int32)
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(
            q, case.k_cache, case.v_cache, case.block_tables, cu, kv, 0.2, max(q_lens), out=out,
            block_m=16, block_n=16, **opts,
        )  # fmt: skip
        ref = paged_prefill_attention_ref(
            q, case.k_cache, case.v_cache, case.block_tables, cu, kv, 0.2, **opts
        )
        err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and err < TOL[dtype]
        failures += not ok
        print(f"prefill {dtype} window {window} softcap {cap}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return failures


def _check_fused_ops(dtype: torch.dtype) -> int:
    """RMSNorm, q/k/v rotary and SiLU-and-mul against the torch code they replace (odd sizes, strided
    rows)."""
    from loraplex.kernels.fused_ops import (
        add_rms_norm,
        add_rms_norm_ref,
        rms_norm,
        rms_norm_ref,
        silu_and_mul,
        silu_and_mul_ref,
    )
    from loraplex.kernels.qkv_rotary import qkv_rotary, qkv_rotary_ref

    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn((5, 100), generator=gen).to(dtype), torch.randn(100, generator=gen).to(dtype)
    qkv = torch.randn((3, 4, 6 * 24), generator=gen).to(dtype)[:, 1]  # rows strided, as a view
    qkv_delta = torch.randn((3, 1000), generator=gen)[:, : 6 * 24]
    freqs = torch.randn((3, 12), generator=gen)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    gate_up = torch.randn((3, 2 * 1500), generator=gen).to(dtype)
    qn, kn = torch.randn(24, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    h, y = torch.randn((5, 100), generator=gen).to(dtype), torch.randn((5, 100), generator=gen).to(dtype)
    # LoRA deltas are float32 views with a wider row stride (the backend's shared delta buffer).
    delta = torch.randn((5, 3200), generator=gen)[:, :100]
    gu_delta = torch.randn((3, 4000), generator=gen)[:, : 2 * 1500]
    added = [add_rms_norm(h, y, w, 1e-5, d) for d in (None, delta)]
    added_ref = [add_rms_norm_ref(h, y, w, 1e-5, d) for d in (None, delta)]
    pairs = [
        ("add_rms_norm h", added[0][0], added_ref[0][0]),
        ("add_rms_norm out", added[0][1], added_ref[0][1]),
        ("add_rms_norm+delta h", added[1][0], added_ref[1][0]),
        ("add_rms_norm+delta out", added[1][1], added_ref[1][1]),
        ("silu_mul+delta", silu_and_mul(gate_up, gu_delta), silu_and_mul_ref(gate_up, gu_delta)),
        ("rms_norm", rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)),
        # Gemma: (1 + weight) norms, GeGLU; Qwen3 / Gemma 3: q/k norms before the rotary
        ("rms_norm unit offset", rms_norm(x, w, 1e-5, True), rms_norm_ref(x, w, 1e-5, True)),
        *(
            (f"add_rms_norm unit offset {i}", got, want)
            for i, (got, want) in enumerate(
                zip(
                    add_rms_norm(h, y, w, 1e-5, delta, unit_offset=True),
                    add_rms_norm_ref(h, y, w, 1e-5, delta, unit_offset=True),
                    strict=True,
                )
            )
        ),
        (
            "gelu_tanh_mul+delta",
            silu_and_mul(gate_up, gu_delta, "gelu_tanh"),
            silu_and_mul_ref(gate_up, gu_delta, "gelu_tanh"),
        ),
        *(
            (f"qkv_rotary qk_norm{' unit offset' if uo else ''} {part}", got, want)
            for uo in (False, True)
            for part, got, want in zip(
                "qkv",
                qkv_rotary(qkv, cos, sin, 4, 1, qkv_delta, qk_norm=(qn, kn, 1e-6, uo)),
                qkv_rotary_ref(qkv, cos, sin, 4, 1, qkv_delta, qk_norm=(qn, kn, 1e-6, uo)),
                strict=True,
            )
        ),
        *(
            (f"qkv_rotary{tag} {part}", out, ref)
            for tag, d in (("", None), ("+delta", qkv_delta))
            for part, out, ref in zip(
                "qkv", qkv_rotary(qkv, cos, sin, 4, 1, d), qkv_rotary_ref(qkv, cos, sin, 4, 1, d), strict=True
            )
        ),
        ("silu_mul", silu_and_mul(gate_up), silu_and_mul_ref(gate_up)),
    ]
    failures = 0
    for name, out, ref in pairs:
        err = rel_err(out, ref)
        ok = out.shape == ref.shape and err < TOL[dtype] / 5
        failures += not ok
        print(f"fused   {dtype} {name}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return failures


def _check_store(dtype: torch.dtype) -> int:
    from loraplex.kernels.attention_kv_store import store_kv, store_kv_ref

    base_k, base_v = torch.randn(6, 4, 2, 24).to(dtype), torch.randn(6, 4, 2, 24).to(dtype)
    caches = [base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()]
    k, v = torch.randn(5, 2, 24).to(dtype), torch.randn(5, 2, 24).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 23])
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    ok = (
        torch.equal(caches[0], caches[2])
        and torch.equal(caches[1], caches[3])
        and not torch.equal(caches[0], base_k)
    )
    print(f"store   {dtype}: {'ok' if ok else 'FAIL'}")
    return int(not ok)


def _check_engine_backend(dtype: torch.dtype, fp8_scales: tuple[float, float] | None = None) -> int:
    """The engine's Triton attention against its torch attention on one mixed step: two decodes,
    a fresh prompt and a chunk after 21 cached tokens, with the same metadata. `fp8_scales`: over an
    FP8 cache with these (k, v) scales (the caches must then agree byte for byte)."""
    from loraplex.kernels.attention_kv_store import quantize_fp8_ref
    from loraplex.services.inference.engine.attention import (
        AttentionMetadata,
        PrefillSegment,
        TorchPagedAttention,
    )
    from loraplex.services.inference.engine.attention_triton import TritonPagedAttention
    from loraplex.services.inference.engine.kv_cache import KVCacheScales

    page, kvh, heads, dim = 4, 2, 4, 16
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn((1, 2, 40, page, kvh, dim), generator=gen).to(dtype)
    scales = None
    if fp8_scales is not None:
        scales = KVCacheScales(1, torch.device("cpu"))
        scales.load_(torch.tensor([fp8_scales]))
        cache = quantize_fp8_ref(cache, 1.0)
    tables = [[7, 3, 12], [5, 0], [9, 2, 30, 31], [1, 4, 6, 8, 10, 11, 13, 14]]
    starts, lens = [9, 5, 0, 21], [1, 1, 13, 9]  # tokens already cached, tokens this step

    def slot(seq: int, p: int) -> int:
        return tables[seq][p // page] * page + p % page

    slot_mapping = [slot(b, p) for b in range(4) for p in range(starts[b], starts[b] + lens[b])]
    segments, ctx_slots, q_start = [], [], 2
    for b in (2, 3):
        ctx = starts[b] + lens[b]
        segments.append(PrefillSegment(q_start, lens[b], len(ctx_slots), ctx))
        ctx_slots += [slot(b, p) for p in range(ctx)]
        q_start += lens[b]
    width = max(len(t) for t in tables[:2])
    meta = AttentionMetadata(
        torch.tensor(slot_mapping),
        2,
        torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]]),
        torch.tensor([starts[0] + 1, starts[1] + 1]),
        segments,
        torch.tensor(ctx_slots),
    )
    t = sum(lens)
    q = torch.randn((t, heads, dim), generator=gen).to(dtype)
    k = torch.randn((t, kvh, dim), generator=gen).to(dtype)
    v = torch.randn((t, kvh, dim), generator=gen).to(dtype)
    failures = 0
    # plain; then a 6-token window (shorter than the chunk's context) with Gemma 2's soft-capping
    for windows, softcap in (((), None), ((6,), 2.5)):
        outs = []
        for cls in (TritonPagedAttention, TorchPagedAttention):
            attn = cls(cache.clone(), dim**-0.5, windows, softcap, kv_scales=scales)
            attn.begin(meta)
            outs.append((attn.forward(0, q, k, v).float(), attn.kv_cache.view(torch.uint8)))
        err = rel_err(outs[0][0], outs[1][0])
        ok = err < TOL[dtype] and torch.equal(outs[0][1], outs[1][1])
        failures += not ok
        print(
            f"engine  {dtype} windows {windows} softcap {softcap}{f' fp8 {fp8_scales}' if scales else ''}: "
            f"triton vs torch attention rel err {err:.2e} {'ok' if ok else 'FAIL'}"
        )
    return failures


# ---- FP8 (E4M3) KV cache: quantize on store, dequantize in the attention kernels ----

FP8_SCALES = ((1.0, 1.0), (0.05, 3.0))  # (k, v): unit (the default) and calibrated-looking scales


def _scale_pair(
    k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k scale, v scale, k inverse, v inverse) as one-element float32 tensors, as KVCacheScales has them."""
    ks, vs = torch.tensor([k_scale]), torch.tensor([v_scale])
    return ks, vs, 1.0 / ks, 1.0 / vs


def _fp8_rows(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Rows that exercise the rounding: exact E4M3 values, ties between neighbours (must go to the even
    one) and a hair either side of them, subnormals, values past +-448 (saturated), scaled by `scale`."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    pool = torch.cat(
        [
            grid,
            mids,
            torch.nextafter(mids, grid[1:]),
            torch.nextafter(mids, grid[:-1]),
            torch.tensor([500.0, -1e4]),
        ]
    )
    pick = pool[torch.randint(0, pool.numel(), shape, generator=gen)]
    wide = (
        torch.randn(shape, generator=gen)
        * torch.tensor([0.003, 0.3, 30.0])[torch.randint(0, 3, shape, generator=gen)]
    )
    x = torch.where(torch.rand(shape, generator=gen) < 0.5, pick, wide) * scale
    return x.to(dtype)


def _check_fp8_store(dtype: torch.dtype) -> int:
    """The store kernel writes the same bytes as torch's cast of the same float32 products (round to
    nearest even, saturated), skips slot -1 and leaves every other slot alone."""
    from loraplex.kernels.attention_kv_store import quantize_fp8_ref, store_kv, store_kv_ref

    gen = torch.Generator().manual_seed(31)
    failures = 0
    for k_scale, v_scale in FP8_SCALES:
        _, _, k_inv, v_inv = _scale_pair(k_scale, v_scale)
        base = quantize_fp8_ref(torch.randn((2, 6, 4, 3, 24), generator=gen), 1.0)
        caches = [base[0].clone(), base[1].clone(), base[0].clone(), base[1].clone()]
        k = _fp8_rows(gen, (7, 3, 24), dtype, k_scale)
        v = _fp8_rows(gen, (7, 3, 24), dtype, v_scale)
        slots = torch.tensor([3, -1, 17, 0, 23, -1, 9])
        store_kv(k, v, caches[0], caches[1], slots, k_inv, v_inv)
        store_kv_ref(k, v, caches[2], caches[3], slots, k_inv, v_inv)
        differ = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            for a, b in zip(caches[:2], caches[2:], strict=True)
        )
        # the reference itself: what was stored reads back within half an E4M3 step of the input
        stored = caches[2].view(-1, 3, 24)[slots[slots >= 0]].float() * k_scale
        want = k[slots >= 0].float().clamp(-448 * k_scale, 448 * k_scale)
        close = bool(((stored - want).abs() <= want.abs() / 16 + 2**-10 * k_scale).all())
        ok = differ == 0 and close and not torch.equal(caches[0].view(torch.uint8), base[0].view(torch.uint8))
        failures += not ok
        print(
            f"fp8     {dtype} store scales {k_scale}/{v_scale}: {differ} bytes differ "
            f"{'ok' if ok else 'FAIL'}"
        )
    return failures


def _fp8_case(lens: list[int], kvh: int, dim: int, page: int, seed: int, k_scale: float, v_scale: float):
    """make_paged_case with the caches quantized to E4M3 with these scales (NaN poison stays NaN)."""
    from loraplex.kernels.attention_kv_store import quantize_fp8_ref

    case = make_paged_case(lens, kvh, dim, page, torch.float32, seed)
    return case._replace(
        k_cache=quantize_fp8_ref(case.k_cache * k_scale, 1.0 / k_scale),
        v_cache=quantize_fp8_ref(case.v_cache * v_scale, 1.0 / v_scale),
    )


def _check_fp8_attention(dtype: torch.dtype) -> int:
    """Decode and prefill kernels over an FP8 cache against the references that dequantize on gather."""
    from loraplex.kernels.attention_decode import paged_decode_attention
    from loraplex.kernels.attention_prefill import paged_prefill_attention

    failures = 0
    for i, (k_scale, v_scale) in enumerate(FP8_SCALES):
        ks, vs, _, _ = _scale_pair(k_scale, v_scale)
        softcap = 2.0 if i else None  # the calibrated case also soft-caps (the scale folds in before it)
        lens = [1, 37, 70, 0]
        case = _fp8_case(lens, 2, 32, 8, 60 + i, k_scale, v_scale)
        q = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(80 + i)).to(dtype)
        ctx = torch.tensor(lens, dtype=torch.int32)
        args = (q, case.k_cache, case.v_cache, case.block_tables, ctx, 0.2)
        ref = paged_decode_attention_ref(*args, softcap=softcap, k_scale=ks, v_scale=vs)
        for f16_dot in (True, False):  # fp16 dots (the default for bf16 q) and q's dtype's
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(
                *args, out=out, block_n=16, softcap=softcap, k_scale=ks, v_scale=vs, f16_dot=f16_dot
            )
            err = rel_err(out, ref)
            # fp16 dots round a float32 q to fp16: that dtype's tolerance
            ok = bool(torch.isfinite(out).all()) and err < TOL[torch.float16 if f16_dot else dtype]
            failures += not ok
            dots = "fp16" if f16_dot else "q's dtype"
            print(
                f"fp8     {dtype} decode scales {k_scale}/{v_scale} {dots} dots: rel err {err:.2e} "
                f"{'ok' if ok else 'FAIL'}"
            )
        kv_lens, q_lens = [5, 70, 40], [5, 33, 1]
        case = _fp8_case(kv_lens, 2, 32, 8, 70 + i, k_scale, v_scale)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), 8, 32, generator=torch.Generator().manual_seed(90 + i)).to(dtype)
        kv = torch.tensor(kv_lens, dtype=torch.int32)
        out = torch.full_like(q, float("nan"))
        args = (q, case.k_cache, case.v_cache, case.block_tables, cu, kv, 0.2)
        paged_prefill_attention(
            *args, max(q_lens), out=out, block_m=16, block_n=16, softcap=softcap, k_scale=ks, v_scale=vs
        )
        ref = paged_prefill_attention_ref(*args, softcap=softcap, k_scale=ks, v_scale=vs)
        err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and err < TOL[dtype]
        failures += not ok
        print(
            f"fp8     {dtype} prefill scales {k_scale}/{v_scale}: rel err {err:.2e} {'ok' if ok else 'FAIL'}"
        )
    return failures


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("set TRITON_INTERPRET=1 to run the kernels on the CPU")
    sys.exit(1 if _interpreter_checks() else 0)
