"""The step suite: one model step of random-weight runners against its floor, bf16 and FP8, the families
and a mixture of experts.

    PYTHONPATH=protos python3 -m loraplex.bench.step [--parts decode,families,moe,prefill] [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.step --tiny      # CPU smoke size (tiny shapes)

Parts (bench/harness.py builds and times every runner; CUDA graphs as the engine captures them):
- decode: batch `--batch` at context `--context` of a Llama-3.1-8B-shaped model, bf16 | FP8 weights |
  FP8 weights + FP8 KV cache | bf16 + FP8 KV | bf16 and FP8 with `--adapters` distinct rank-16
  adapters; each against its memory floor (weights as stored + the batch's K/V + the adapters' A/B,
  over the copy bandwidth measured in the same run) and against the bf16 step;
- families: the decode step of Qwen3-8B and Gemma-2-9B shapes, base vs floor and `--adapters` adapters
  vs base (issue 37: <= 1.3x floor, >= 0.92x);
- moe: a Qwen3-30B-A3B shape (adapters on q/k/v/o), base vs its active-parameter floor (the top-k
  experts per token) and adapters vs base (issue 39: <= 1.5x, >= 0.85x);
- prefill: 8 fresh prompts of `--prefill / 8` tokens in one eager step, base and adapters, against
  the compute floor (the linears' FLOPs over the bf16 matmul rate measured here).
On the CPU the floors are '-' (no bandwidth is measured there). Writes step.json (bench/results.py).
"""

from __future__ import annotations

import sys

import torch

from loraplex.bench import harness as h
from loraplex.bench.random_runner import FAMILY_SHAPES, TINY, TINY_FAMILIES
from loraplex.bench.results import add_out_argument, write_json

FP8_KV = torch.float8_e4m3fn
PARTS = ("decode", "families", "moe", "prefill")
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    rope_theta=1000000.0,
)


def decode_cases(adapters: int, base: str) -> dict[str, tuple[str, bool, torch.dtype | None, int]]:
    """key -> (name, FP8 weights, KV dtype or None for the float one, distinct adapters); `base` names
    the float type (bf16 on the GPU, fp32 on the CPU)."""
    return {
        "base": (base, False, None, 0),
        "fp8": ("fp8 weights", True, None, 0),
        "fp8_kv8": ("fp8 weights + fp8 KV", True, FP8_KV, 0),
        "kv8": (f"{base} + fp8 KV", False, FP8_KV, 0),
        "base_lora": (f"{base} + {adapters} adapters", False, None, adapters),
        "fp8_lora": (f"fp8 weights + {adapters} adapters", True, None, adapters),
    }


def run_decode(o, device, bw, keys: list[str] | None = None) -> dict[str, dict]:
    """The decode cases of `keys` (all by default), each on a freshly built runner, side by side;
    `x_base` against the first case's time (the float base when it is run)."""
    rows: dict[str, dict] = {}
    base = "bf16" if device.type == "cuda" else "fp32"
    for key, (name, fp8, kv, n) in decode_cases(o.adapters, base).items():
        if keys is not None and key not in keys:
            continue
        rows[key] = r = h.decode_step(
            h.model_shape(o.tiny),
            device,
            batch=o.batch,
            context=o.context,
            repeats=o.repeats,
            bandwidth=bw,
            adapters=n,
            fp8=fp8,
            kv_dtype=kv,
            name=name,
        )
        h.log(f"decode {name}: {r['ms']:.3f} ms, x floor {h.fmt(r['x_floor'])}")
    first = next(iter(rows.values()))["ms"]
    for r in rows.values():
        r["x_base"] = r["ms"] / first
    return rows


def run_families(o, device, bw) -> list[dict]:
    models = (
        {f"tiny-{f}": {**TINY, **TINY_FAMILIES[f]} for f in ("qwen3", "gemma2")} if o.tiny else FAMILY_SHAPES
    )
    rows = []
    for name, shape in models.items():
        runner, pages = h.step_runner(shape, device, batch=o.batch, context=o.context, adapters=o.adapters)
        base = h.time_step(runner, h.decode_chunks(o.batch, o.context, pages, 0), o.repeats)
        lora = h.time_step(runner, h.decode_chunks(o.batch, o.context, pages, o.adapters), o.repeats)
        read = h.weight_bytes(runner.model) + h.kv_bytes(runner, o.batch, o.context)
        floor = read / bw * 1e3 if bw else None
        rows.append(
            dict(model=name, base_ms=base, floor_ms=floor, adapters_ms=lora, adapters_vs_base=base / lora)
        )
        rows[-1]["x_floor"] = base / floor if floor else None
        del runner
        h.free(device)
        h.log(f"family {name}: base {base:.3f} ms, {o.adapters} adapters {lora:.3f} ms")
    return rows


def active_weight_bytes(runner) -> int:
    """The weights one token's step reads: everything but the experts, plus top_k experts per layer."""
    experts_all = one = 0
    for layer in runner.model.layers:
        if layer.moe is not None:
            size = sum(p.nbytes for p in (layer.moe.gate_up, layer.moe.down))
            experts_all, one = experts_all + size, one + size // layer.moe.num_experts
    return h.weight_bytes(runner.model) - experts_all + runner.config.moe.top_k * one


def run_moe(o, device, bw) -> list[dict]:
    models = {f"tiny-{f}": {**TINY, **TINY_FAMILIES[f]} for f in ("qwen3_moe", "mixtral")} if o.tiny else {}
    models = models or {"qwen3-30b-a3b": QWEN3_30B_A3B}
    rows = []
    for name, shape in models.items():
        runner, pages = h.step_runner(shape, device, batch=o.batch, context=o.context, adapters=o.adapters)
        base = h.time_step(runner, h.decode_chunks(o.batch, o.context, pages, 0, True), o.repeats)
        lora = h.time_step(runner, h.decode_chunks(o.batch, o.context, pages, o.adapters, True), o.repeats)
        read = active_weight_bytes(runner) + h.kv_bytes(runner, o.batch, o.context)
        floor = read / bw * 1e3 if bw else None
        rows.append(
            dict(
                model=name,
                base_ms=base,
                active_floor_ms=floor,
                adapters_ms=lora,
                adapters_vs_base=base / lora,
            )
        )
        rows[-1]["x_active_floor"] = base / floor if floor else None
        del runner
        h.free(device)
        h.log(f"moe {name}: base {base:.3f} ms, {o.adapters} adapters {lora:.3f} ms")
    return rows


def run_prefill(o, device, rate) -> list[dict]:
    segments = 8
    per = o.prefill // segments
    shape = h.model_shape(o.tiny)
    runner, pages = h.step_runner(
        shape, device, batch=segments, context=per, adapters=o.adapters, max_tokens=o.prefill, graphs=False
    )
    params = sum(p.numel() for layer in runner.model.layers for p in layer.parameters() if p.dim() >= 2)
    head = shape["vocab_size"] * shape["hidden_size"]
    flops = 2 * per * segments * params + 2 * segments * head  # the lm_head runs on the sampled rows only
    floor = flops / rate * 1e3 if rate else None
    rows = []
    for adapters in (0, min(o.adapters, segments)):
        ms = h.time_step(runner, h.prefill_chunks(per * segments, pages, adapters, segments), o.repeats)
        rows.append(dict(case=f"prefill {segments}x{per}, {adapters} adapters", ms=ms, floor_ms=floor))
        rows[-1]["x_floor"] = ms / floor if floor else None
        h.log(f"{rows[-1]['case']}: {ms:.2f} ms")
    del runner
    h.free(device)
    return rows


def parser():
    p = h.suite_parser("step", __doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--batch", type=int, default=None, help="decode batch (default 64; --tiny 4)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default 1024; --tiny 32)")
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters in the adapter cases")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 4096; --tiny 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 50; --tiny 3)")
    add_out_argument(p)
    return p


def defaults(o) -> None:
    o.batch = o.batch or (4 if o.tiny else 64)
    o.context = o.context or (32 if o.tiny else 1024)
    o.prefill = o.prefill or (64 if o.tiny else 4096)
    o.repeats = o.repeats or (3 if o.tiny else 50)


def main(argv: list[str] | None = None) -> int:
    o = parser().parse_args(argv)
    defaults(o)
    device = h.pick_device(o.device)
    parts = [p for p in o.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {','.join(PARTS)}")
    bw, rate = h.copy_bandwidth(device), h.matmul_rate(device)
    result = dict(
        meta=h.meta(device, o.tiny), bandwidth=bw, matmul_rate=rate, batch=o.batch, context=o.context
    )
    h.log(f"step suite on {result['meta']['device']}: bandwidth {h.fmt(bw and bw / 1e12, '.2f')} TB/s")
    if "decode" in parts:
        result["decode"] = rows = run_decode(o, device, bw)
        print(f"\ndecode step, batch {o.batch}, context {o.context}")
        h.print_table(
            ["case", "ms", "read GB", "floor ms", "x floor", f"x {rows['base']['case']}"],
            [
                [r["case"], r["ms"], r["read_gb"], r["floor_ms"], r["x_floor"], r["x_base"]]
                for r in rows.values()
            ],
        )
    if "families" in parts:
        result["families"] = rows = run_families(o, device, bw)
        print(f"\nfamilies, decode batch {o.batch}, context {o.context}")
        h.print_table(
            ["model", "base ms", "floor ms", "x floor", f"{o.adapters} adapters ms", "adapters / base speed"],
            [
                [
                    r["model"],
                    r["base_ms"],
                    r["floor_ms"],
                    r["x_floor"],
                    r["adapters_ms"],
                    r["adapters_vs_base"],
                ]
                for r in rows
            ],
        )
    if "moe" in parts:
        result["moe"] = rows = run_moe(o, device, bw)
        print(f"\nmixture of experts, decode batch {o.batch}, context {o.context}")
        h.print_table(
            [
                "model",
                "base ms",
                "active floor ms",
                "x floor",
                f"{o.adapters} adapters ms",
                "adapters / base speed",
            ],
            [
                [
                    r["model"],
                    r["base_ms"],
                    r["active_floor_ms"],
                    r["x_active_floor"],
                    r["adapters_ms"],
                    r["adapters_vs_base"],
                ]
                for r in rows
            ],
        )
    if "prefill" in parts:
        result["prefill"] = rows = run_prefill(o, device, rate)
        print("\nprefill step (eager)")
        h.print_table(
            ["case", "ms", "compute floor ms", "x floor"],
            [[r["case"], r["ms"], r["floor_ms"], r["x_floor"]] for r in rows],
        )
    write_json(o.out, "step", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
