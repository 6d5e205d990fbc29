"""Whether the LoRA kernels use programmatic dependent launch (PDL, Hopper and newer).

With PDL a kernel is launched while the previous kernel in the stream still runs: its
programs start, read what the previous kernel cannot be writing (the step's segment
metadata, the pool's rank tables), then `gdc_wait` until the previous kernel's writes are
visible, and only then read activations or write anything. That hides the launch gap and
the metadata round trips behind the previous kernel's tail, which is most of what eight
small kernels per layer cost in decode. Contract: `build_segments` and pool uploads are
never the launch directly before a LoRA kernel (a model runs other work in between).

Off by default: measured on an H200 (docs/benchmarks.md) it made a decoder layer's LoRA work
slower, not faster. LORAPLEX_LORA_PDL=1 turns it on (sm_90+, compiled Triton only).
"""

from __future__ import annotations

import os

import torch

_state: dict[str, bool] = {}


def pdl_enabled() -> bool:
    if "on" not in _state:
        _state["on"] = os.environ.get("LORAPLEX_LORA_PDL", "0") == "1" and pdl_capable()
    return _state["on"]


def set_pdl(on: bool) -> None:
    """Force PDL on (where capable) or off; benchmarks compare both."""
    _state["on"] = bool(on) and pdl_capable()


def pdl_capable() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as tl_cuda

        return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")
    except ImportError:
        return False


def launch_kwargs() -> dict:
    """Extra kwargs for a kernel launch: the USE_PDL constexpr, and launch_pdl where on."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled() else {"USE_PDL": False}
