"""The quality suite: what FP8 weights cost in next-token quality, and whether a shortfall is ours or E4M3's.

Teacher forced over `--positions` positions of real text (this repository's docs), on the embedded
SmolLM2-135M (or `--model DIR`), every variant against the bf16 model: next-token top-1 agreement,
mean KL(bf16 || variant), agreement where bf16 is confident (top-1 probability >= `--confident`),
and each variant's own top-1 accuracy against the text. Variants:

- float32 (control): a precision change of another kind, the noise floor of the measure;
- fp8 per-channel, served: `quantize_loaded` (the `--quantization fp8` linears; on the CPU their
  reference path: weights dequantized to bf16, activations not quantized, what the weight-only GEMM
  computes);
- fp8 per-channel, torch round trip: the same scheme written independently here (amax / 448,
  `tensor.to(torch.float8_e4m3fn)`), so a defect in our quantization shows as a difference;
- + per-token FP8 activations: what the `torch._scaled_mm` path (LORAPLEX_FP8_GEMM=scaled_mm) computes;
- block 128x128 and per-tensor scales (round trips); and lm_head (SmolLM2 ties it to the
  embedding) quantized per channel too, which loraplex never does; attention or MLP alone;
- fp8 per-channel vs float32, both in float32: the quantization alone, without bf16's noise.

    PYTHONPATH=protos python3 -m loraplex.bench.quality              # CPU, ~5 min on 2 cores
    PYTHONPATH=protos python3 -m loraplex.bench.quality --positions 200  # smoke

Writes quality.json (bench/results.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.bench.results import add_out_argument, write_json
from loraplex.services.inference.engine.kv_cache import allocate_kv_cache
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.scheduled_batch import SeqChunk
from loraplex.services.inference.models.llama import FusedLinear
from loraplex.services.inference.models.quantization.fp8_linear import quantize_loaded

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
WINDOW = 512
REPO = Path(__file__).resolve().parents[1]
TEXT_FILES = ["docs/architecture.md", "docs/operations.md", "docs/walkthrough.md", "README.md"]


def text_ids(tokenizer, positions: int) -> list[int]:
    """The first `positions + 1` tokens of this repository's docs: real text every checkout has."""
    text = "\n\n".join((REPO / f).read_text() for f in TEXT_FILES if (REPO / f).exists())
    ids = tokenizer(text).input_ids
    if len(ids) < positions + 1:
        raise SystemExit(f"only {len(ids)} tokens of text in {TEXT_FILES}; pass --positions {len(ids) - 1}")
    return ids[: positions + 1]


@torch.inference_mode()
def all_logits(model, cfg, ids: list[int], device, dtype: torch.dtype, window: int) -> torch.Tensor:
    """Teacher-forced logits `[len(ids) - 1, vocab]` (float32), in independent windows of `window`."""
    blocks = -(-window // 16) + 1
    kv = allocate_kv_cache(cfg, blocks, 16, dtype, device)
    runner = ModelRunner(model, cfg, kv, max_num_tokens=window, max_num_seqs=1, context_length=window + 16)
    outs = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : min(start + window, len(ids) - 1)]
        logits = runner.forward([SeqChunk(chunk, 0, list(range(blocks)), -1, True, True)])
        outs.append(logits[1:].float())  # row 0: the sampled row; then one per token
    return torch.cat(outs)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--confident", type=float, default=0.5, help="bf16 top-1 probability called confident")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--only", default="", help="comma list of words: run the variants naming one (and the references)"
    )
    add_out_argument(p)
    return p.parse_args(argv)


# ---- independent FP8 round trips (plain torch; nothing of loraplex's quantization) ----


def round_trip(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`w`'s E4M3 values times `scale` (broadcast over w), in w's dtype."""
    wf = w.float()
    return ((wf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale).to(w.dtype)


def per_channel(w: torch.Tensor) -> torch.Tensor:
    return round_trip(w, w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX)


def per_tensor(w: torch.Tensor) -> torch.Tensor:
    return round_trip(w, w.float().abs().amax().clamp(min=1e-12) / E4M3_MAX)


def per_block(w: torch.Tensor, bn: int = 128, bk: int = 128) -> torch.Tensor:
    """Block scales as the block-wise checkpoints hold them; partial blocks at the edges."""
    n, k = w.shape
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / E4M3_MAX
    out = round_trip(blocks, scale).view_as(padded)[:n, :k]
    return out.to(w.dtype)


ATTENTION = ("qkv_proj", "o_proj")
MLP = ("gate_up_proj", "down_proj")


def requantize_linears(model, fn: Callable[[torch.Tensor], torch.Tensor], attrs=ATTENTION + MLP) -> None:
    """Replace the decoder linears' weights (`attrs` of each layer), each projection of a fused
    linear on its own (the checkpoints scale q, k, v, gate and up separately)."""
    for layer in model.layers:
        for module in (getattr(layer, attr) for attr in attrs):
            for start, size in zip(module.offsets, module.out_sizes, strict=True):
                rows = module.weight.data[start : start + size]
                rows.copy_(fn(rows))


def weight_error(model) -> dict:
    """Per scheme, over every decoder linear: relative RMS error of the E4M3 weights and the share of
    elements that land on E4M3's subnormals (below 2^-6 after scaling: fewer than 3 mantissa bits)."""
    out = {}
    for name, fn in (("per-channel", per_channel), ("block 128x128", per_block), ("per-tensor", per_tensor)):
        err = ref = 0.0
        for layer in model.layers:
            for attr in ATTENTION + MLP:
                module = getattr(layer, attr)
                for start, size in zip(module.offsets, module.out_sizes, strict=True):
                    w = module.weight.data[start : start + size].float()
                    err += (fn(w) - w).square().sum().item()
                    ref += w.square().sum().item()
        out[name] = dict(rel_rms_error=(err / ref) ** 0.5)
    subnormal = total = 0
    for layer in model.layers:
        for attr in ATTENTION + MLP:
            w = getattr(layer, attr).weight.data.float()
            scaled = w.abs() / (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX)
            subnormal += int(((scaled < 2**-6) & (w != 0)).sum())
            total += w.numel()
    out["per-channel"]["subnormal_share"] = subnormal / total
    return out


def quantize_activations_per_token(model) -> None:
    """Round every decoder linear's input through E4M3 with a per-token scale (amax / 448), as the
    `torch._scaled_mm` path quantizes them."""

    def hook(_module, args):
        (x,) = args
        scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        return (round_trip(x, scale),)

    for module in model.modules():
        if isinstance(module, FusedLinear):
            module.register_forward_pre_hook(hook)


def quantize_lm_head(model) -> None:
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head
    model.lm_head = torch.nn.Parameter(per_channel(weight.data.clone()), requires_grad=False)


# name -> (compute dtype, reference: "bf16" or "float32", what to do to a freshly loaded model)
VARIANTS: dict[str, tuple[str, str, Callable | None]] = {
    "bf16 (reference)": ("bf16", "bf16", None),
    "float32 (control)": ("float32", "bf16", None),
    "fp8 per-channel, served": ("bf16", "bf16", lambda m: quantize_loaded(m)),
    "fp8 per-channel, torch round trip": ("bf16", "bf16", lambda m: requantize_linears(m, per_channel)),
    "fp8 per-channel + per-token activations": (
        "bf16",
        "bf16",
        lambda m: (quantize_loaded(m), quantize_activations_per_token(m)),
    ),
    "fp8 block 128x128": ("bf16", "bf16", lambda m: requantize_linears(m, per_block)),
    "fp8 per-tensor": ("bf16", "bf16", lambda m: requantize_linears(m, per_tensor)),
    "fp8 per-channel + lm_head fp8": ("bf16", "bf16", lambda m: (quantize_loaded(m), quantize_lm_head(m))),
    "fp8 per-channel, attention only": (
        "bf16",
        "bf16",
        lambda m: requantize_linears(m, per_channel, ATTENTION),
    ),
    "fp8 per-channel, MLP only": ("bf16", "bf16", lambda m: requantize_linears(m, per_channel, MLP)),
    "float32 (reference)": ("float32", "float32", None),
    "fp8 per-channel, float32 compute": ("float32", "float32", lambda m: quantize_loaded(m)),
}
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor, confident: float) -> dict:
    ref_logp, got_logp = ref.log_softmax(-1), got.log_softmax(-1)
    ref_top, got_top = ref.argmax(-1), got.argmax(-1)
    agree = ref_top == got_top
    kl = F.kl_div(got_logp, ref_logp, log_target=True, reduction="none").sum(-1)
    probs = ref_logp.exp()
    top2 = probs.topk(2, dim=-1).values
    sure = top2[:, 0] >= confident
    margin = top2[:, 0] - top2[:, 1]
    flips = ~agree
    return dict(
        top1_agreement=agree.float().mean().item(),
        mean_kl=kl.mean().item(),
        max_kl=kl.max().item(),
        confident_positions=int(sure.sum()),
        confident_agreement=agree[sure].float().mean().item() if sure.any() else None,
        disagreements=int(flips.sum()),
        # How close bf16's own top two were where the variant picked another token.
        flips_with_margin_below_0_1=int((flips & (margin < 0.1)).sum()),
        text_accuracy=(got_top == targets).float().mean().item(),
    )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from loraplex.services.inference.default_model import ensure_model
    from loraplex.services.inference.models.loader import load_model

    path = a.model or ensure_model()
    device = torch.device(a.device)
    ids = text_ids(AutoTokenizer.from_pretrained(path), a.positions)
    targets = torch.tensor(ids[1:])
    logits: dict[str, torch.Tensor] = {}
    rows = []
    print(f"{path.name}: {a.positions} positions, teacher forced in windows of {WINDOW}, on {device}")
    print(f"{'variant':<42}{'vs':>8}{'top-1':>8}{'mean KL':>10}{'confident':>14}{'flips<0.1':>11}", end="")
    print(f"{'text acc':>10}")
    words = [w for w in a.only.split(",") if w]
    for name, (dtype_name, ref_name, prepare) in VARIANTS.items():
        if words and "(reference)" not in name and not any(w in name for w in words):
            continue
        start = time.perf_counter()
        model, cfg = load_model(path, device, DTYPES[dtype_name])
        if prepare is not None:
            prepare(model)
        logits[name] = all_logits(model, cfg, ids, device, DTYPES[dtype_name], WINDOW).cpu()
        del model
        ref = logits[f"{ref_name} (reference)"]
        row = dict(variant=name, dtype=dtype_name, reference=ref_name, seconds=time.perf_counter() - start)
        row |= compare(ref, logits[name], targets, a.confident)
        rows.append(row)
        sure = f"{row['confident_agreement']:.4f}/{row['confident_positions']}"
        print(
            f"{name:<42}{ref_name:>8}{row['top1_agreement']:>8.4f}{row['mean_kl']:>10.5f}{sure:>14}"
            f"{row['flips_with_margin_below_0_1']:>6}/{row['disagreements']:<4}"
            f"{row['text_accuracy']:>10.4f}",
            flush=True,
        )
    same = diff = None
    served, independent = (
        logits.get("fp8 per-channel, served"),
        logits.get("fp8 per-channel, torch round trip"),
    )
    if served is not None and independent is not None:
        same = (served.argmax(-1) == independent.argmax(-1)).float().mean().item()
        diff = (served - independent).abs().max().item()
        print(f"served vs round trip: same top-1 at {same:.4f} of positions, max |logit diff| {diff:.3g}")
    weights = weight_error(load_model(path, device, torch.bfloat16)[0])
    for scheme, stats in weights.items():
        print(f"weights {scheme}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()))
    write_json(
        a.out,
        "quality",
        dict(
            model=path.name,
            positions=a.positions,
            confident_threshold=a.confident,
            rows=rows,
            served_vs_round_trip=dict(top1_identical=same, max_abs_logit_diff=diff),
            weight_error=weights,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
