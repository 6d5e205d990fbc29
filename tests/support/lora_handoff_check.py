"""Child process of tests/unit/test_lora_handoff.py (TRITON_INTERPRET=1).

1. The one-launch LoRA handoff against the two-kernel path (bit for bit under the interpreter) and the
   torch references on random cases (`loraplex.kernels.lora_handoff_check`: mixed ranks, 1 to 256
   adapters, K-splits, block and per-token expands, in-place and delta modes, counters left zero).
2. A tiny random Llama with three adapters, greedy over a mixed prefill then decodes, through the Triton
   LoRA backend with the handoff on against off, with the side stream's delta mode and without: the same
   tokens and logits, the handoff kernel really ran, and every launch left the counters zero.

Prints JSON lines for the kernel cases, then one `engine ...` line per mode; exits non-zero on a failure.
"""

from __future__ import annotations

import inspect
import sys

import loraplex.services.inference.lora.triton_backend as triton_backend
from loraplex.kernels import lora_handoff_check
from tests.support.lora_fused_check import greedy

CALLS = [0]
DIRTY = [0]  # launches that left the backend's counters non-zero
_real = triton_backend.lora_handoff
_SIGNATURE = inspect.signature(_real)  # finds `counters` however the backend passes it


def _counting(*args, **kwargs):
    CALLS[0] += 1
    out = _real(*args, **kwargs)
    DIRTY[0] += bool(_SIGNATURE.bind(*args, **kwargs).arguments["counters"].any())
    return out


def engine_check() -> int:
    triton_backend.lora_handoff = _counting
    failures = 0
    try:
        for side in (False, True):
            CALLS[0] = 0
            want, want_logits = greedy("off", side, handoff=False)
            calls_off = CALLS[0]
            got, got_logits = greedy("off", side, handoff=True)
            calls_on = CALLS[0] - calls_off
            err = max(float((g - w).norm() / w.norm()) for g, w in zip(got_logits, want_logits, strict=True))
            ok = got == want and err == 0.0 and calls_off == 0 and calls_on > 0 and DIRTY[0] == 0
            failures += not ok
            print(
                f"engine side_stream={side}: tokens equal {got == want}, logits rel err {err:.2e},"
                f" handoff launches {calls_on} (off: {calls_off}), counters left non-zero {DIRTY[0]}"
                f" {'ok' if ok else 'FAIL'}",
                flush=True,
            )
    finally:
        triton_backend.lora_handoff = _real
    return failures


def main() -> int:
    return 1 if lora_handoff_check.main() + engine_check() else 0


if __name__ == "__main__":
    sys.exit(main())
