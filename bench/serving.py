"""Serving benchmark on one GPU, one process, one run.

    PYTHONPATH=protos python3 -m loraplex.bench.serving [--adapters 64] [--skip-compile] [--tiny]
        [--tp-size N] [--out DIR]

1. measures the copy bandwidth and bf16 matmul rate of this GPU;
2. writes a Llama-3.1-8B-shaped HF directory (random bf16 weights) and N random rank-16 PEFT
   adapters on all seven projections (bench/serving_setup.py);
3. builds the engine with the server's `build_engine` and measures decode ms/step and tokens/s at
   batch 1/16/32/64/256 over 1024-token contexts, batch 32 and 64 over 8 adapters, batch 64 over
   64 distinct adapters, prefill of 8x1024 with and without adapters; each decode step against its
   memory floor (weights + KV read + distinct adapters' bytes, over the measured copy bandwidth);
   then (unless --no-variants) the batch-64 rows again with overlap scheduling off and with the LoRA
   side stream switched, in the same process, checking that greedy outputs do not change;
4. frees the engine and runs the baselines at batch 32 on the same prompts and adapters
   (bench/serving_baselines.py): transformers + PEFT mixed batch, transformers static cache +
   torch.compile.
Prints a table; writes serving.json to --out DIR (bench/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import random
import sys
import time
from pathlib import Path

import torch

from loraplex.bench import serving_setup as setup
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_engine import ForwardClock, graph_replay_ms, measure_decode, measure_prefill

log = logging.getLogger("loraplex.bench.serving")
TINY = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
)


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s), medians of do_bench."""
    import triton

    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return bw, 2 * 8192**3 / (ms * 1e-3)


def kernel_check(shape: dict) -> dict[str, float]:
    """bf16 fused kernels against the torch code they replace, at this model's shapes (GPU only)."""
    from loraplex.kernels.fused_ops import (
        add_rms_norm,
        add_rms_norm_ref,
        rms_norm,
        rms_norm_ref,
        silu_and_mul,
        silu_and_mul_ref,
    )
    from loraplex.kernels.qkv_rotary import qkv_rotary, qkv_rotary_ref

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    d = h // heads
    x, w = (
        torch.randn(64, h, device="cuda", dtype=torch.bfloat16),
        torch.rand(h, device="cuda", dtype=torch.bfloat16),
    )
    kv_heads = shape["num_key_value_heads"]
    qkv = torch.randn(64, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
    qkv_delta = torch.randn(64, (heads + 2 * kv_heads) * d, device="cuda") * 0.1
    f = torch.rand(64, d // 2, device="cuda") * 100
    cos, sin = f.cos().bfloat16(), f.sin().bfloat16()
    gu = torch.randn(64, 2 * shape["intermediate_size"], device="cuda", dtype=torch.bfloat16)
    y, delta = torch.randn_like(x), torch.randn(64, h, device="cuda") * 0.1
    gu_delta = torch.randn(64, 2 * shape["intermediate_size"], device="cuda") * 0.1
    added, added_ref = add_rms_norm(x, y, w, 1e-5, delta), add_rms_norm_ref(x, y, w, 1e-5, delta)
    return dict(
        rms_norm=err(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)),
        add_rms_norm_h=err(added[0], added_ref[0]),
        add_rms_norm=err(added[1], added_ref[1]),
        silu_mul_delta=err(silu_and_mul(gu, gu_delta), silu_and_mul_ref(gu, gu_delta)),
        **{
            f"qkv_rotary{tag}_{part}": err(a, b)
            for tag, dd in (("", None), ("_delta", qkv_delta))
            for part, a, b in zip(
                "qkv",
                qkv_rotary(qkv, cos, sin, heads, kv_heads, dd),
                qkv_rotary_ref(qkv, cos, sin, heads, kv_heads, dd),
                strict=True,
            )
        },
        silu_mul=err(silu_and_mul(gu), silu_and_mul_ref(gu)),
    )


def build(model_dir: Path, opts: argparse.Namespace, num_adapters: int):
    from loraplex.services.inference.engine.async_engine import AsyncEngine
    from loraplex.services.inference.engine.build import build_engine
    from loraplex.services.inference.server_args import ServerArgs

    args = ServerArgs.from_fields(
        model_path=str(model_dir),
        dtype="bfloat16",
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_loras_per_batch=max(8, num_adapters),
        max_lora_rank=16,
        lora_target_modules=("all",),
        max_running_requests=opts.max_bs,
        cuda_graph_max_bs=opts.max_bs,
        context_length=opts.context_length,
        chunked_prefill_size=8192,
        max_num_batched_tokens=8192 + opts.max_bs,
        mem_fraction_static=opts.mem_fraction,
        disable_cuda_graph=opts.disable_cuda_graph,
        overlap_schedule=False if opts.disable_overlap_schedule else None,
        tp_size=opts.tp_size,
        lora_backend=opts.lora_backend,
    )
    start = time.perf_counter()
    async_engine = build_engine(args.engine, args.lora)
    # We drive LLMEngine.step() ourselves, on this thread: stop only the engine thread (the
    # base class's shutdown), so tensor-parallel workers stay up until engine_section ends.
    asyncio.run(AsyncEngine.shutdown(async_engine))
    return async_engine, time.perf_counter() - start


def engine_section(
    model_dir: Path, adapter_dirs: list[Path], prompts: list[list[int]], opts, res: dict
) -> None:
    async_engine, build_s = build(model_dir, opts, len(adapter_dirs))
    try:
        _measure_engine(async_engine, build_s, adapter_dirs, prompts, opts, res)
    finally:
        asyncio.run(async_engine.shutdown())  # TP: stops the workers and the process group


def _measure_engine(
    async_engine, build_s: float, adapter_dirs: list[Path], prompts: list[list[int]], opts, res: dict
) -> None:
    engine, manager = async_engine.engine, async_engine.lora_manager
    graphs = getattr(engine.runner, "cuda_graphs", None)
    res["engine_build_s"] = build_s
    res["cuda_graphs"] = (
        None
        if graphs is None
        else dict(
            batch_sizes=graphs.ladder,
            capture_s=graphs.capture_seconds,
            capture_mib=graphs.capture_bytes / 2**20,
        )
    )
    names = [f"a{i:02d}" for i in range(len(adapter_dirs))]
    start = time.perf_counter()
    for name, path in zip(names, adapter_dirs, strict=True):
        manager.load_adapter(name, str(path))
    res["adapters_load_s"] = time.perf_counter() - start
    # Greedy tokens for a correctness comparison with transformers + PEFT (done in the baselines).
    from loraplex.services.inference.engine.types import SamplingParams

    check_prompts, check_adapters = [p[:48] for p in prompts[:4]], [None, None, 0, 1]
    done = engine.generate(
        check_prompts,
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        [None if a is None else names[a] for a in check_adapters],
    )
    res["greedy_engine"] = [c.token_ids for c in done]
    res["check"] = (check_prompts, check_adapters, 8)
    clock = ForwardClock(engine)
    decode = res["decode"] = []

    slots = manager.slots_total()

    def run(batch: int, distinct: int, variant: str = "") -> None:
        adapters = [None] * batch if distinct == 0 else [names[i % distinct] for i in range(batch)]
        if distinct > slots:
            # The rows time N distinct adapters resident in one batch, not slots taking turns. The
            # pool is sized from memory: at --mem-fraction 0.7 an 80 GB card holds 50 all-module
            # rank-16 slots beside this KV cache (0.85 holds 64).
            msg = f"decode {batch}/{distinct} {variant}: the pool holds {slots} slots; raise --mem-fraction"
            log.warning("%s", msg)
            res.setdefault("errors", []).append(msg)
            return
        try:
            t = measure_decode(engine, clock, prompts[:batch], adapters, steps=opts.decode_steps)
        except Exception as exc:  # keep the rest of the run; the table says what failed
            log.exception("decode batch %d, %d adapters (%s) failed", batch, distinct, variant or "default")
            res.setdefault("errors", []).append(
                f"decode {batch}/{distinct} {variant}: {type(exc).__name__}: {exc}"
            )
            for rid in list(engine.requests):
                engine.abort_request(rid)
            return
        row = t._asdict() | dict(distinct_adapters=distinct, variant=variant)
        row["graph_gpu_ms"] = graph_replay_ms(engine, batch, distinct) if graphs is not None else None
        decode.append(row)
        log.info("decode %s", row)

    mixed = [
        (b, d)
        for b, d in sorted({(32, 8), (64, 8), (64, min(64, len(names)))})
        if b <= opts.max_bs and d <= len(names)
    ]
    for batch in opts.batches:
        run(batch, 0)
    for batch, distinct in mixed:
        run(batch, distinct)
    n_pre = min(8, len(prompts))
    res["prefill"] = [
        measure_prefill(engine, prompts[:n_pre], [None] * n_pre) | dict(distinct_adapters=0),
        measure_prefill(engine, prompts[:n_pre], [names[i % len(names)] for i in range(n_pre)])
        | dict(distinct_adapters=min(n_pre, len(names))),
    ]
    if opts.variants:
        from loraplex.bench.serving_variants import run_variants

        run_variants(engine, run, mixed, check_prompts, check_adapters, names, res)


def add_floors(res: dict, shape: dict, bw: float) -> None:
    def is_base(r: dict, batch: int) -> bool:
        return r["batch"] == batch and r["distinct_adapters"] == 0 and not r.get("variant")

    for row in res["decode"]:
        if not any(is_base(r, row["batch"]) for r in res["decode"]):
            continue
        byts = (
            setup.weight_bytes(shape)
            + row["batch"] * row["mean_context"] * setup.kv_bytes_per_token(shape)
            + row["distinct_adapters"] * setup.adapter_bytes(shape)
        )
        row["floor_ms"] = 1e3 * byts / bw
        row["x_floor"] = row["ms_per_step"] / row["floor_ms"]
        base = next(r for r in res["decode"] if is_base(r, row["batch"]))
        row["ratio_to_base"] = row["tokens_per_s"] / base["tokens_per_s"]
    pre = res["prefill"]
    if len(pre) == 2:
        pre[1]["ratio_to_base"] = pre[1]["tokens_per_s"] / pre[0]["tokens_per_s"]


def print_table(res: dict) -> None:
    print(
        f"\ncopy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {res['matmul_rate'] / 1e12:.0f} TFLOP/s"
    )
    print(
        "decode: ratio = tokens/s over the base model's at the same batch; gpu ms = one replay of the "
        "step's CUDA graph; host = step - gpu (schedule / sample / output ms: stop checks + detokenize)"
    )
    print(
        f"{'measurement':<44}{'batch':>6}{'ms/step':>9}{'tok/s':>10}{'floor ms':>10}{'x floor':>9}"
        f"{'ratio':>8}{'gpu ms':>8}{'host %':>8}  host split"
    )
    for r in res["decode"]:
        if "floor_ms" not in r:
            continue
        what = "decode base" if not r["distinct_adapters"] else f"decode {r['distinct_adapters']} adapters"
        what += f" ({r['variant']})" if r.get("variant") else ""
        gpu = f"{r['graph_gpu_ms']:.2f}" if r.get("graph_gpu_ms") else "-"
        host = r["ms_per_step"] - (r.get("graph_gpu_ms") or r["forward_ms"])
        split = f"{r['schedule_ms']:.2f}/{r['sample_ms']:.2f}/{r['output_ms']:.2f}"
        print(
            f"{what:<44}{r['batch']:>6}{r['ms_per_step']:>9.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['floor_ms']:>10.2f}{r['x_floor']:>9.2f}{r['ratio_to_base']:>8.3f}{gpu:>8}"
            f"{100 * host / r['ms_per_step']:>7.1f}%  {split}"
        )
    for p in res["prefill"]:
        what = f"prefill {p['prompts']}x{p['tokens'] // p['prompts']}" + (
            f" {p['distinct_adapters']} adapters" if p["distinct_adapters"] else " base"
        )
        ratio = f"{p['ratio_to_base']:.3f}" if "ratio_to_base" in p else "-"
        print(
            f"{what:<44}{p['prompts']:>6}{1e3 * p['seconds']:>9.1f}{p['tokens_per_s']:>10.0f}"
            f"{'':>10}{'':>9}{ratio:>8}"
        )
    for key, ours in (("hf_peft_mixed", (32, 8)), ("hf_static_compile", (32, 0))):
        b = res.get("baselines", {}).get(key)
        if not b or "error" in b:
            print(f"{key:<44} {b.get('error') if b else 'not run'}")
            continue
        mine = next(
            (
                r
                for r in res["decode"]
                if (r["batch"], r["distinct_adapters"]) == ours and not r.get("variant")
            ),
            None,
        )
        ratio = mine["tokens_per_s"] / b["decode_tokens_per_s"] if mine else float("nan")
        b["ours_over_it"] = ratio
        print(
            f"{key:<44}{b['batch']:>6}{b['ms_per_step']:>9.2f}{b['decode_tokens_per_s']:>10.0f}"
            f"{'':>10}{'':>9}"
            f"{'':>8}   ours/it = {ratio:.1f}x"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--work", default="/tmp/loraplex-bench")
    add_out_argument(p)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--baseline-new-tokens", type=int, default=33)
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true", help="the step split needs it off")
    p.add_argument("--mem-fraction", type=float, default=0.7)
    p.add_argument(
        "--batches",
        default="",
        help="base-model decode batch sizes, comma-separated (default: 1,16,32,64,256)",
    )
    p.add_argument("--lora-backend", default=None, choices=["triton", "torch"], help="default: the server's")
    p.add_argument(
        "--no-variants",
        dest="variants",
        action="store_false",
        help="skip the rows with overlap scheduling off and with the LoRA side stream off",
    )
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test of this script)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one GPU each; gloo on CPU)")
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    shape = TINY if opts.tiny else setup.LLAMA_8B
    ctx = 64 if opts.tiny else 1024
    if opts.batches:
        opts.batches = [int(b) for b in opts.batches.split(",")]
    else:
        opts.batches = [1, 4, 8, 32, 64] if opts.tiny else [1, 16, 32, 64, 256]
    opts.max_bs = max(opts.batches)
    opts.context_length = 2048 if not opts.tiny else 256
    res: dict = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        shape=shape,
        context=ctx,
        argv=sys.argv[1:],
        blas="cublaslt",  # the engine's model runner sets it (services/inference/engine/model_runner.py)
    )
    res["copy_bw"], res["matmul_rate"] = ceilings() if torch.cuda.is_available() else (1e11, 1e12)
    if torch.cuda.is_available():
        res["kernel_check"] = kernel_check(shape)
    work = Path(opts.work)
    start = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = setup.write_model_dir(work / "model", shape, device=dev)
    adapter_dirs = setup.write_adapters(work / "adapters", model_dir, opts.adapters, shape, device=dev)
    res["setup_s"] = time.perf_counter() - start
    rng = random.Random(0)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(ctx)] for _ in range(opts.max_bs)]
    try:
        engine_section(model_dir, adapter_dirs, prompts, opts, res)
    except Exception as exc:
        log.exception("engine section failed")
        res.setdefault("errors", []).append(f"engine: {type(exc).__name__}: {exc}")
        res.setdefault("decode", [])
        res.setdefault("prefill", [])
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        log.info("after the engine: %.1f GiB allocated", torch.cuda.memory_allocated() / 2**30)
    add_floors(res, shape, res["copy_bw"])
    if not opts.skip_baselines:
        from loraplex.bench.serving_baselines import run_baselines

        ids = torch.tensor(prompts[:32], device=dev)
        res["baselines"] = run_baselines(
            model_dir,
            adapter_dirs[:8],
            ids,
            opts.baseline_new_tokens,
            skip_compile=opts.skip_compile,
            check=res.get("check"),
        )
        ref = res["baselines"].pop("greedy_reference", None)
        if ref is not None and "greedy_engine" in res:
            ours = res["greedy_engine"]
            res["greedy_agreement"] = dict(
                first_token=sum(a[0] == b[0] for a, b in zip(ours, ref, strict=True)) / len(ref),
                all_tokens=sum(
                    x == y for a, b in zip(ours, ref, strict=True) for x, y in zip(a, b, strict=True)
                )
                / sum(len(b) for b in ref),
                rows_identical=[a == b for a, b in zip(ours, ref, strict=True)],
            )
    print_table(res)
    if "greedy_agreement" in res:
        print(
            "greedy tokens vs transformers+PEFT (2 base rows, 2 adapter rows, 8 tokens):",
            res["greedy_agreement"],
        )
    for key in ("greedy_no_overlap_equal", "greedy_variants_equal"):
        if key in res:
            print(f"{key}: {res[key]}")
    if "kernel_check" in res:
        print("bf16 kernels vs torch:", {k: f"{v:.1e}" for k, v in res["kernel_check"].items()})
    write_json(opts.out, "serving", res)
    for err in res.get("errors", []):
        print("ERROR", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
