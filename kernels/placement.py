"""Where the Triton kernels run: on CUDA tensors, and (tests only) on CPU tensors under the
interpreter.

The model and the engine pick a Triton kernel or its torch reference per tensor with
`triton_runs_on`. `run_triton_on_cpu(True)` (only with TRITON_INTERPRET=1) makes a CPU engine
take the CUDA path's kernels through Triton's interpreter, so the tests can check what that path
launches (kernels/compile_watch.py) and what it computes, without a GPU.
"""

from __future__ import annotations

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
