"""Child process of tests/integration/test_base_step_kernels.py (TRITON_INTERPRET=1): the base decode step's
fused launches (issue 38; on wherever Triton runs) against their torch references and against the
launches they replace.

- skinny gated GEMM (`kernels/skinny_gemm.py`): random shapes, K splits, bias, SiLU / GeGLU epilogue,
  float32 and float16 (the interpreter's bfloat16 dot is wrong: 16-bit coverage is float16);
- q/k/v split with the fused KV store: q and the cache (float, and FP8's bytes) bit-identical to
  the split then the separate store (padding slots -1 untouched), with and without a LoRA delta
  and q/k norms;
- decode attention written directly by its single split: within float32 rounding of the torch
  reference and of two splits merged;
- a tiny model's greedy decode (8 sequences, with LoRA on some) on the Triton path: the same tokens
  as the torch path's, and each fused launch taken (launches counted).

Prints one line per check and exits non-zero on a failure.
"""

from __future__ import annotations

import random
import sys

import torch

from loraplex.kernels import attention_decode, skinny_gemm
from loraplex.kernels.attention_decode import paged_decode_attention
from loraplex.kernels.attention_kv_store import store_kv_ref
from loraplex.kernels.attention_ref import paged_decode_attention_ref
from loraplex.kernels.qkv_rotary import qkv_rotary
from loraplex.kernels.skinny_gemm import SkinnyConfig, skinny_gated, skinny_gated_ref

failures: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)
    if not ok:
        failures.append(name)


def check_skinny(rnd: random.Random) -> None:
    for case in range(6):
        dtype = (torch.float32, torch.float16)[case % 2]
        act = ("silu", "gelu_tanh")[case // 3 % 2]
        m, n, k = rnd.randint(1, 64), rnd.randint(1, 80), rnd.randint(16, 300)
        split = (1, 2, rnd.choice([3, 5]))[case % 3]
        cfg = SkinnyConfig(rnd.choice([16, 32]), rnd.choice([16, 32, 64]), split, 4, 2)
        x = torch.randn(m, k, dtype=dtype)
        w = torch.randn(2 * n, k, dtype=dtype) / k**0.5
        b = torch.randn(w.shape[0], dtype=dtype) if case % 4 == 1 else None
        got, want = skinny_gated(x, w, b, act, cfg), skinny_gated_ref(x, w, b, act)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = float((got.float() - want.float()).abs().max())
        ok = got.shape == want.shape and got.dtype == dtype and err <= tol * (1 + float(want.abs().max()))
        report(f"skinny {dtype} {act} m={m} n={n} k={k} split={split}", ok, f"max err {err:.2e}")
    # split-K again right after: the arrival counters were left at zero
    x, w = torch.randn(5, 256), torch.randn(48, 256)
    cfg = SkinnyConfig(16, 32, 4, 4, 2)
    first, again = skinny_gated(x, w, config=cfg), skinny_gated(x, w, config=cfg)
    counts = skinny_gemm._counter_buffer(x.device)
    report("skinny split-K repeatable", torch.equal(first, again) and not counts.any())


def check_fused_store(rnd: random.Random) -> None:
    q_heads, kv_heads, dim, page, pages = 4, 2, 16, 4, 6
    for case in range(4):
        tokens = rnd.randint(1, 9)
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim)
        cos, sin = torch.randn(tokens, dim // 2), torch.randn(tokens, dim // 2)
        delta = torch.randn_like(qkv) * 0.1 if case % 2 else None
        norm = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5, 1e-6, False) if case >= 2 else None
        slots = torch.tensor(rnd.sample(range(pages * page), tokens), dtype=torch.int64)
        slots[rnd.randrange(tokens)] = -1  # a padding row: no write
        caches = [torch.randn(pages, page, kv_heads, dim) for _ in range(2)]
        want_k, want_v = (c.clone() for c in caches)
        q_want, k, v = qkv_rotary(qkv, cos, sin, q_heads, kv_heads, delta, qk_norm=norm)
        store_kv_ref(k, v, want_k, want_v, slots)
        q_got, k_none, v_none = qkv_rotary(
            qkv, cos, sin, q_heads, kv_heads, delta, qk_norm=norm, kv_cache=(caches[0], caches[1], slots)
        )
        ok = (
            torch.equal(q_got, q_want)
            and torch.equal(caches[0], want_k)
            and torch.equal(caches[1], want_v)
            and k_none is None
            and v_none is None
        )
        report(f"fused kv store tokens={tokens} delta={delta is not None} qk_norm={norm is not None}", ok)
    # An FP8 cache: the same bytes as the separate store's rounding (values off the E4M3 grid, some
    # past 448 after scaling, so saturation and ties are exercised), padding rows untouched.
    for k_scale, v_scale in ((1.0, 1.0), (0.01, 3.0)):
        tokens = 7
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim) * 3
        cos, sin = torch.randn(tokens, dim // 2), torch.randn(tokens, dim // 2)
        slots = torch.tensor(rnd.sample(range(pages * page), tokens), dtype=torch.int64)
        slots[rnd.randrange(tokens)] = -1
        inv = (torch.tensor([1 / k_scale]), torch.tensor([1 / v_scale]))
        caches = [torch.randint(0, 120, (pages, page, kv_heads, dim), dtype=torch.uint8) for _ in range(2)]
        caches = [c.view(torch.float8_e4m3fn) for c in caches]
        want_k, want_v = (c.clone() for c in caches)
        q_want, k, v = qkv_rotary(qkv, cos, sin, q_heads, kv_heads)
        store_kv_ref(k, v, want_k, want_v, slots, *inv)
        q_got, _, _ = qkv_rotary(
            qkv, cos, sin, q_heads, kv_heads, kv_cache=(caches[0], caches[1], slots, *inv)
        )
        ok = (
            torch.equal(q_got, q_want)
            and torch.equal(caches[0].view(torch.uint8), want_k.view(torch.uint8))
            and torch.equal(caches[1].view(torch.uint8), want_v.view(torch.uint8))
        )
        report(f"fused kv store into an FP8 cache, scales {k_scale}/{v_scale}", ok)


def check_decode_direct(rnd: random.Random) -> None:
    heads, kv_heads, dim, page, pages = 4, 2, 16, 4, 12
    for batch in (1, 3):
        k_cache, v_cache = torch.randn(2, pages, page, kv_heads, dim)
        lens = torch.tensor([rnd.randint(0, 20) for _ in range(batch)], dtype=torch.int64)
        lens[-1] = 0 if batch > 1 else lens[-1]  # a padding row: zeros either way
        tables = torch.tensor([rnd.sample(range(pages), 5) for _ in range(batch)], dtype=torch.int64)
        q = torch.randn(batch, heads, dim)
        direct = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=1)
        merged = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=2)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
        ok = torch.allclose(direct, ref, atol=1e-5, rtol=1e-5) and torch.allclose(direct, merged, atol=1e-5)
        padded = bool((direct[lens == 0] == 0).all())
        err = float((direct - ref).abs().max())
        report(f"decode direct batch={batch} lens={lens.tolist()}", ok and padded, f"max err {err:.1e}")


class Counter:
    """Wraps a launcher (a function, or a jitted kernel's `kernel[grid]`) and counts calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getitem__(self, grid):
        self.calls += 1
        return self.inner[grid]


def greedy_tokens(
    triton: bool, counters: dict[str, Counter], targets: tuple[str, ...] | None = None
) -> list[list[int]]:
    from loraplex.bench.random_runner import TINY, build_runner
    from loraplex.kernels.placement import run_triton_on_cpu
    from loraplex.services.inference.engine.scheduled_batch import SeqChunk

    for c in counters.values():
        c.calls = 0
    run_triton_on_cpu(triton)
    try:
        runner = build_runner(
            TINY,
            dtype=torch.float32,
            device=torch.device("cpu"),
            slots=2,
            rank=4,
            max_num_tokens=96,
            max_num_seqs=8,
            context_length=32,
            page_size=4,
            num_blocks=80,
            target_modules=targets,
        )
        rnd = random.Random(3)
        # Short prompts (every token is a Triton program per launch under the interpreter): one
        # past a 4-token page (a prefill crossing pages), one filling a page exactly (its first
        # decode opens a page).
        lens = [2, 6, 4, 3, 2, 3, 2, 3]
        seqs = [[rnd.randrange(TINY["vocab_size"]) for _ in range(n)] for n in lens]
        lora = [-1, 0, -1, -1, 1, -1, -1, -1]
        tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(8)]
        new: list[list[int]] = [[] for _ in seqs]
        for step in range(3):
            if step == 0:
                chunks = [
                    SeqChunk(s, 0, t, slot, True) for s, t, slot in zip(seqs, tables, lora, strict=True)
                ]
            else:
                chunks = [
                    SeqChunk([s[-1]], len(s) - 1, t, slot, True)
                    for s, t, slot in zip(seqs, tables, lora, strict=True)
                ]
                if step == 2:  # the last step without adapters: the fused SiLU path (no delta pending)
                    chunks = [c._replace(lora_slot=-1) for c in chunks]
            logits = runner.forward(chunks)
            for i, tok in enumerate(logits.argmax(-1).tolist()):
                seqs[i].append(tok)
                new[i].append(tok)
        return new
    finally:
        run_triton_on_cpu(False)


def check_greedy() -> None:
    from loraplex.services.inference.engine import attention_triton

    counters = {
        "skinny": Counter(skinny_gemm._launch),
        "store": Counter(attention_triton.store_kv),
        "merge": Counter(attention_decode._decode_merge_kernel),
    }
    skinny_gemm._launch = counters["skinny"]
    attention_triton.store_kv = counters["store"]
    attention_decode._decode_merge_kernel = counters["merge"]
    ref = greedy_tokens(False, counters)
    ref_calls = {k: c.calls for k, c in counters.items()}
    got = greedy_tokens(True, counters)
    calls = {k: c.calls for k, c in counters.items()}
    report("greedy tokens, Triton path == torch path", got == ref, f"{got[:2]}... vs {ref[:2]}...")
    # the torch path launches no kernel; the Triton path's gate_up runs skinny in the steps without
    # adapters, and its decode steps need no separate store and (8 x 2 programs: one split) no merge
    fused = calls["skinny"] > 0 and calls["store"] == 0 and calls["merge"] == 0
    taken = not any(ref_calls.values()) and fused
    report("each fused launch taken", taken, f"torch path {ref_calls}, Triton path {calls}")
    # Adapters on q/k/v/o only: no delta is ever pending on gate_up, so the adapter steps take the
    # skinny launch too (every step, not only the last one)
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    ref = greedy_tokens(False, counters, attn)
    got = greedy_tokens(True, counters, attn)
    skinny = counters["skinny"].calls
    ok = got == ref and skinny == 3 * calls["skinny"]
    report("q/k/v/o adapters: gate_up skinny in every step", ok, f"{skinny} vs {calls['skinny']} launches")


def main() -> int:
    rnd = random.Random(0)
    torch.manual_seed(0)
    check_skinny(rnd)
    check_fused_store(rnd)
    check_decode_direct(rnd)
    check_greedy()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
