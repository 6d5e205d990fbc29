"""Where the Triton kernels run: on CUDA tensors, and (tests only) on CPU tensors under the
interpreter.

The model and the engine pick a Triton kernel or its torch reference per tensor with
`triton_runs_on`. `run_triton_on_cpu(True)` (only with TRITON_INTERPRET=1) makes a CPU engine
take the CUDA path's kernels through Triton's interpreter, so the tests can check what that path
launches (kernels/compile_watch.py) and what it computes, without a GPU.
"""

from __future__ import annotations

import functools

import torch

from loraplex.kernels.settings import kernel_settings

_on_cpu = [False]


def run_triton_on_cpu(on: bool) -> None:
    if on and not kernel_settings().triton_interpret:
        raise RuntimeError("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    _on_cpu[0] = bool(on)


def triton_runs_on(t: torch.Tensor | torch.device) -> bool:
    """Whether the Triton kernels (rather than the torch references) serve tensors on this device."""
    is_cuda = t.type == "cuda" if isinstance(t, torch.device) else t.is_cuda
    return is_cuda or _on_cpu[0]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _pdl_capable(t: torch.Tensor) -> bool:
    """A CUDA device of compute capability 9 or more (Hopper): never the interpreter."""
    if not t.is_cuda:
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether the LoRA kernels launch on `t`'s device with programmatic dependent launch: wherever the
    device has it (the layer's LoRA 0.83-1.00x the time without, bit-identical, H100, 2026-12-05;
    docs/benchmarks.md, "Facts behind defaults")."""
    return _pdl_capable(t)
