"""The kernels suite (GPU): one decoder layer's LoRA shrink + expand and the paged attention kernels at
Llama-3.1-8B shapes, each against its floor.

    PYTHONPATH=protos python3 -m loraplex.bench.kernels [--parts lora,attention,fp8,upload] [--out DIR]
    PYTHONPATH=protos python3 -m loraplex.bench.kernels --tiny    # GPU smoke size: a few cases
    PYTHONPATH=protos python3 -m loraplex.bench.kernels --tune-lora --parts lora   # another GPU or shape

- lora: per scenario (decode batches 16/64/256 over 1/8/64 distinct adapters, prefill 8x512 over 8;
  ranks 16 and 64) the layer's LoRA work (qkv, o, gate_up, down; shrink then expand, the configs the
  engine picks), checked in bf16 against the torch reference, then timed as replays of one CUDA graph
  over C copies of every input and adapter weight (C x bytes > 4x the L2, so the L2 holds none of
  it), against the floor max(bytes that must move / copy bandwidth, FLOPs / bf16 matmul rate), both
  measured in this run (bench/lora_layer.py has the layer's shapes and floors);
- attention: the paged decode kernel over bf16 and FP8 caches (batches 1/16/64/256 at context
  1,024) against the KV bytes over the bandwidth, the prefill kernel (8x1024; 8x512 after 1,024
  cached) against its FLOPs over the matmul rate; each checked against its torch reference first,
  timed as replays of a graph calling it once per layer over distinct per-layer caches;
- fp8: one decoder layer's four FP8 linears (q/k/v, o, gate/up, down; per-channel scales, the GEMM
  the engine picks for each row count) at 1/16/64/256 rows, each checked against float32 over its
  dequantized weight (max error over the |x| |w| bound < 2^-4: the W8A8 GEMM quantizes activations
  to E4M3, 3 mantissa bits), then timed against the layer's FP8 weight bytes over the bandwidth;
- upload: one q/k/v/o adapter's host-to-GPU upload into the pool, packed per group against per
  (layer, module) (bench/lora_upload.py): the engine thread's ms per upload, ms until ready, GB/s.
A failed check exits 1 before timing. On the CPU only `--parts upload` runs; the rest says it needs
CUDA (the interpreter checks are tests/integration/test_kernels_lora.py and test_attention_kernels.py).
Writes kernels.json.
`--tune-lora` first sweeps the decode LoRA configuration (bench/lora_sweep.py) and writes
lora_configs.json for LORAPLEX_LORA_CONFIGS; the FP8 GEMMs' tuner is `python -m loraplex.bench.fp8_gemm`.
"""

from __future__ import annotations

import sys

import torch

from loraplex.bench import harness as h
from loraplex.bench.attention_kernels import attention_checks, attention_rows
from loraplex.bench.graph_timing import graph_time_us
from loraplex.bench.lora_layer import DEVICE, GROUPS, floor_of, launch_of, make_copies, token_slots
from loraplex.bench.results import add_out_argument, write_json
from loraplex.kernels.lora_configs import MANY_ADAPTERS, expand_config, shrink_config, shrink_splits
from loraplex.kernels.lora_expand import lora_expand, lora_expand_ref
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.lora_shrink import lora_shrink, lora_shrink_ref

DT = torch.bfloat16
TOL = 2e-2  # bf16 inputs and outputs


def lora_scenario(tokens: int, distinct: int, rank: int, prefill: bool = False) -> dict:
    kind = "prefill 8x512" if prefill else f"decode T={tokens}"
    name = f"{kind} adapters={distinct} r={rank}"
    return dict(name=name, tokens=tokens, distinct=min(distinct, tokens), rank=rank, prefill=prefill)


def lora_scenarios(tiny: bool) -> list[dict]:
    if tiny:
        return [lora_scenario(16, 4, 16), lora_scenario(64, 8, 16)]
    out = [lora_scenario(t, a, r) for r in (16, 64) for t in (16, 64, 256) for a in (1, 8, 64) if a <= t]
    return out + [lora_scenario(4096, 8, r, prefill=True) for r in (16, 64)]


def lora_launches(sc: dict) -> dict:
    """group -> the launch the engine's tables pick for this many tokens, adapters and rank (over
    MANY_ADAPTERS distinct: the `decode_many` entries, as kernels/lora_plan.py plans them)."""
    out, many = {}, sc["distinct"] > MANY_ADAPTERS
    for g, (d, widths) in GROUPS.items():
        n, r, t = len(widths), sc["rank"], sc["tokens"]
        shrink, expand = shrink_config(d, n, r, t), expand_config(sum(widths), n, r, t, many)
        out[g] = launch_of(sc, shrink, shrink_splits(d, t, many), expand)
    return out


def lora_fns(copy: dict, segs, sc: dict, launches: dict) -> list:
    """The layer's shrink and expand launches over one copy of the inputs, in order."""
    fns = []
    for g, (_, widths) in GROUPS.items():
        c, launch = copy[g], launches[g]
        y = torch.zeros(launch.splits, sc["tokens"], len(widths) * sc["rank"], device=DEVICE)
        fns.append(
            lambda c=c, y=y, launch=launch: lora_shrink(
                c["x"], c["A"], c["ranks"], c["pages"], segs, y, launch
            )
        )
        fns.append(
            lambda c=c, y=y, w=widths, launch=launch: lora_expand(
                y, c["B"], c["ranks"], c["scal"], c["pages"], segs, c["out"], w, launch
            )
        )
    return fns


def lora_check(copy: dict, segs, sc: dict, launches: dict) -> float:
    """Worst relative error of the layer's output deltas, Triton vs the torch reference, in bf16."""
    worst = 0.0
    for g, (_, widths) in GROUPS.items():
        p, launch = copy[g], launches[g]
        y = torch.full((launch.splits, sc["tokens"], len(widths) * sc["rank"]), float("nan"), device=DEVICE)
        y_ref = torch.full_like(y, float("nan"))
        lora_shrink(p["x"], p["A"], p["ranks"], p["pages"], segs, y, launch)
        lora_shrink_ref(p["x"], p["A"], p["ranks"], p["pages"], segs, y_ref)
        out, out_ref = p["out"].clone(), p["out"].clone()
        lora_expand(y, p["B"], p["ranks"], p["scal"], p["pages"], segs, out, widths, launch)
        lora_expand_ref(y_ref, p["B"], p["ranks"], p["scal"], p["pages"], segs, out_ref, widths)
        delta, delta_ref = out.float() - p["out"].float(), out_ref.float() - p["out"].float()
        err = ((delta - delta_ref).norm() / delta_ref.norm()).item()
        worst = max(worst, err if err == err else float("inf"))  # NaN: unwritten rows
    return worst


def lora_layer(sc: dict, bw: float, rate: float) -> dict:
    """One scenario: the layer's check, floor and graph time (us) and the ratio."""
    bytes_ = flops = 0.0
    for g in GROUPS:
        for kernel in ("shrink", "expand"):
            _, b, f = floor_of(sc, g, kernel, bw, rate)
            bytes_, flops = bytes_ + b, flops + f
    copies = make_copies(sc, bytes_)
    slots = token_slots(sc)
    segs = build_segments(slots, alloc_segments(sc["tokens"], sc["distinct"], DEVICE))
    launches = lora_launches(sc)
    err = lora_check(copies[0], segs, sc, launches)
    row = dict(sc, copies=len(copies), bf16_rel_err=err, ok=err < TOL)
    if row["ok"]:
        per_copy = [lambda fns=lora_fns(c, segs, sc, launches): [f() for f in fns] for c in copies]
        floor_us = max(bytes_ / bw, flops / rate) * 1e6
        row.update(floor_us=floor_us, graph_us=graph_time_us(per_copy), bytes=bytes_, flops=flops)
        row["x_floor"] = row["graph_us"] / floor_us
    del copies
    torch.cuda.empty_cache()
    return row


def fp8_layer(bw: float, tiny: bool) -> tuple[list[dict], list[str]]:
    """(rows, failures): a random Llama-3.1-8B layer's linears quantized as `--quantization fp8` does."""
    from loraplex.bench.random_runner import model_config, random_model
    from loraplex.bench.serving_setup import LLAMA_8B
    from loraplex.services.inference.models.quantization.fp8_linear import quantize_loaded

    model = quantize_loaded(
        random_model(model_config({**LLAMA_8B, "num_hidden_layers": 1}, 2048), DT, DEVICE)
    )
    linears = {a: getattr(model.layers[0], a) for a in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    nbytes = sum(m.weight.nbytes + m.weight_scale.nbytes for m in linears.values())
    rows, failed = [], []
    for n in (16,) if tiny else (1, 16, 64, 256):
        for name, m in linears.items():
            x = torch.randn(n, m.weight.shape[1], device=DEVICE, dtype=DT)
            w = m.dequantized()
            err = (
                (m(x).float() - x.float() @ w.T).abs() / (x.float().abs() @ w.abs().T).clamp(min=1e-6)
            ).max()
            if not err < 2**-4:
                failed.append(f"fp8 {name} rows {n}: error {err:.2e} of the bound")
        xs = [torch.randn(n, m.weight.shape[1], device=DEVICE, dtype=DT) for m in linears.values()]
        us = graph_time_us([lambda xs=xs: [m(x) for m, x in zip(linears.values(), xs, strict=True)]])
        rows.append(dict(rows=n, us=us, floor_us=nbytes / bw * 1e6, x_floor=us / (nbytes / bw * 1e6)))
        h.log(f"fp8 layer, {n} rows: {us:.1f} us, x floor {rows[-1]['x_floor']:.2f}")
    del model
    torch.cuda.empty_cache()
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    p = h.suite_parser("kernels", __doc__.split("\n")[0])
    p.add_argument(
        "--parts",
        default="lora,attention,fp8,upload",
        help="comma-separated subset of lora,attention,fp8,upload",
    )
    p.add_argument(
        "--tune-lora",
        action="store_true",
        help="first choose the decode K-splits and block sizes for 64 tokens over 8 and over 64 adapters "
        "at once (another GPU or model shape); writes lora_configs.json (LORAPLEX_LORA_CONFIGS) to --out "
        "and measures with it",
    )
    add_out_argument(p)
    o = p.parse_args(argv)
    device = h.pick_device(o.device)
    result: dict = dict(meta=h.meta(device, o.tiny))
    parts = o.parts.split(",")
    if device.type != "cuda" and parts != ["upload"]:
        print("the kernels suite needs CUDA (the CPU's interpreter checks are in tests/integration)")
        write_json(o.out, "kernels", dict(result, skipped="needs CUDA"))
        return 0
    if parts == ["upload"]:
        upload_part(device, o, result)
        return 0
    bw, rate = h.copy_bandwidth(device), h.matmul_rate(device)
    result.update(bandwidth=bw, matmul_rate=rate)
    h.log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    failed = []
    if o.tune_lora:
        from loraplex.bench.lora_sweep import joint_sweep
        from loraplex.kernels.lora_configs import load_overrides

        chosen, result["lora_tuning"] = joint_sweep([lora_scenario(64, 8, 16), lora_scenario(64, 64, 16)])
        load_overrides(str(write_json(o.out, "lora_configs", chosen)))
        h.log(f"LoRA tuning chose {chosen}; the lora part below runs with it")
    if "lora" in o.parts:
        result["lora"] = rows = []
        for sc in lora_scenarios(o.tiny):
            rows.append(lora_layer(sc, bw, rate))
            r = rows[-1]
            h.log(f"lora {sc['name']}: x floor {h.fmt(r.get('x_floor'))}, bf16 err {r['bf16_rel_err']:.1e}")
            write_json(o.out, "kernels", result)  # after each: a late failure keeps the rest
        failed += [r["name"] for r in rows if not r["ok"]]
        print("\none decoder layer's LoRA (shrink + expand, 4 module groups), CUDA graph replays")
        h.print_table(
            ["scenario", "floor us", "us", "x floor", "bf16 rel err"],
            [
                [r["name"], r.get("floor_us"), r.get("graph_us"), r.get("x_floor"), r["bf16_rel_err"]]
                for r in rows
            ],
        )
    if "attention" in o.parts:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        result["attention_errors"] = errs = attention_checks(gen)
        failed += [f"{k}: rel err {v:.2e}" for k, v in errs.items() if not v < TOL]
        if not failed:
            result["attention"] = rows = attention_rows(bw, rate, gen, o.tiny)
            print("\npaged attention (default configs), per layer")
            h.print_table(
                ["kernel", "floor us", "us", "x floor"],
                [[r["kernel"], r["floor_us"], r["us"], r["x_floor"]] for r in rows],
            )
    if "fp8" in o.parts:
        result["fp8"], fp8_failed = fp8_layer(bw, o.tiny)
        failed += fp8_failed
        print("\none decoder layer's four FP8 linears (per-channel scales), CUDA graph replays")
        rows = [[r["rows"], r["floor_us"], r["us"], r["x_floor"]] for r in result["fp8"]]
        h.print_table(["rows", "floor us", "us", "x floor"], rows)
    if "upload" in o.parts:
        upload_part(device, o, result)
    result["failed"] = failed
    write_json(o.out, "kernels", result)
    for f in failed:
        print(f"FAIL {f}")
    return 1 if failed else 0


def upload_part(device: torch.device, o, result: dict) -> None:
    """bench/lora_upload.py's rows, printed and written (on the CPU too: its copies are synchronous)."""
    from loraplex.bench.lora_upload import upload_rows

    result["upload"] = rows = upload_rows(device, o.tiny)
    print("\none adapter's upload into the pool (q/k/v/o, bf16; host copy pinned on CUDA)")
    keys = ["rank", "layout", "mb", "host_ms", "ready_ms", "gb_per_s"]
    h.print_table(
        ["rank", "host layout", "MB", "engine thread ms", "ms until ready", "GB/s"],
        [[r[k] for k in keys] for r in rows],
    )
    write_json(o.out, "kernels", result)


if __name__ == "__main__":
    sys.exit(main())
