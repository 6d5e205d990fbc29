"""bench/moe.py's correctness checks and kernel switch: which kernel runs the experts
(`models/moe.py`'s MOE_TORCH_ON_CUDA, set here), and before timing, on CUDA, that the grouped kernel's decode
step equals the torch experts' and that its CUDA-graph replay equals its eager run."""

from __future__ import annotations

import torch

from loraplex.services.inference.models import moe as moe_module
from loraplex.services.inference.models.moe import DENSE_MAX_TOKENS

KERNELS = ("torch", "grouped")


def use_moe_kernel(kernel: str) -> None:
    """Run MoE layers with `kernel` (grouped / torch) from now on."""
    moe_module.MOE_TORCH_ON_CUDA = kernel == "torch"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _eager(runner, chunks) -> torch.Tensor:
    graphs, runner.cuda_graphs = runner.cuda_graphs, None
    try:
        return runner.forward(chunks).clone()
    finally:
        runner.cuda_graphs = graphs


def check_layer(runner, batch: int, device: torch.device) -> list[str]:
    """The first MoE layer: grouped vs the torch paths on random hidden states. FAIL lines."""
    block = next(layer.moe for layer in runner.model.layers if layer.moe is not None)
    x = torch.randn(batch, block.gate.shape[1], device=device, dtype=block.gate.dtype)
    w, e = block.route(x)
    grouped = block._grouped(x, w, e)
    refs = {"sorted": block._sorted(x, w, e)}
    if batch <= DENSE_MAX_TOKENS:
        refs["dense"] = block._dense(x, w, e)
    fails = []
    for name, ref in refs.items():
        err = rel_err(grouped, ref)
        ok = err < 1.5e-2
        print(f"{'ok' if ok else 'FAIL'}: layer grouped vs {name} (batch {batch}): rel err {err:.2e}")
        fails += [] if ok else [f"layer {name} {err}"]
    return fails


def check_step(runner, chunks, device: torch.device, graphs: bool) -> list[str]:
    """Decode-step logits: grouped eager vs torch eager (bf16: loose), grouped graph replay vs grouped
    eager (the same kernels: tight). FAIL lines."""
    fails = check_layer(runner, len(chunks), device)
    use_moe_kernel("torch")
    torch_logits = _eager(runner, chunks)
    # Control: the two torch paths (dense, sorted) differ only in bf16 summation order; over 48 random
    # layers top-k routing flips amplify that, so the grouped step is held to what torch vs torch shows.
    moe_module.DENSE_MAX_TOKENS = 0
    try:
        sorted_logits = _eager(runner, chunks)
    finally:
        moe_module.DENSE_MAX_TOKENS = DENSE_MAX_TOKENS
    control = rel_err(sorted_logits, torch_logits)
    print(f"info: step torch sorted vs torch dense (control): {control:.2e}")
    use_moe_kernel("grouped")
    grouped = _eager(runner, chunks)
    tol = max(5e-2, 2 * control)
    checks = [("step grouped vs torch experts (eager)", rel_err(grouped, torch_logits), tol)]
    # random weights give flat logits: bf16 rounding flips some argmaxes, so this one only informs
    agree = (grouped.argmax(-1) == torch_logits.argmax(-1)).float().mean().item()
    print(f"info: greedy tokens equal, grouped vs torch experts: {agree:.0%} of the batch")
    if graphs and device.type == "cuda":
        # same kernels: a graph-unsafe step (a stale sort or tile table) would be off by ~1, not 1e-2
        runner.capture_cuda_graphs(len(chunks))
        replay = runner.forward(chunks).clone()
        checks.append(("step grouped graph replay vs eager", rel_err(replay, grouped), 1e-2))
    for name, err, tol in checks:
        ok = err < tol
        print(f"{'ok' if ok else 'FAIL'}: {name}: {err:.2e} (< {tol:g})")
        fails += [] if ok else [f"{name} {err}"]
    return fails
