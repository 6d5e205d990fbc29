"""Value checks of checkpoint tensors that would otherwise be served as NaN (issue 59): FP8 scales and
mixture-of-experts routers. Each raises ValueError naming the tensor; the loader turns it into
UnsupportedModelError, one line at start.

Only small tensors are checked here (a scale is one value per channel or block, a router one row per
expert): a pass over every weight of the model would add seconds to a start on the CPU.
"""

from __future__ import annotations

import torch


def check_scale(name: str, tensor: torch.Tensor) -> None:
    """An FP8 scale must be finite and positive: 0 zeroes its weights, a negative one flips their
    signs, and NaN or Inf makes every output of its linear NaN."""
    values = tensor.detach().float()
    bad = ~torch.isfinite(values) | (values <= 0)
    if bool(bad.any()):
        first = float(values[bad].flatten()[0])
        raise ValueError(f"{name!r}: FP8 scales must be finite and positive; it holds {first:g}")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """A weight that must hold no NaN or Inf (a router's: NaN scores route every token nowhere)."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name!r} holds NaN or Inf values")
