"""The kernels' environment settings, typed and read in one place.

Operator settings only, each documented in docs/operations.md with why a user would set it (tables
for a GPU or model shape the built-in ones were not measured on; the FP8 GEMM where speed is not the
only concern). Which kernel variant does a job is not a setting: each job runs the one measured
fastest on the H100 and H200, and the losers were deleted (docs/benchmarks.md, "Facts behind defaults").

Read once, at first use (`kernel_settings()`); modules of `kernels/` and the services read
these fields instead of `os.environ`. Triton reads `TRITON_INTERPRET` itself when a kernel is
decorated, so it must be set before the first kernel module is imported: the field here only
mirrors it, for the checks that refuse CPU tensors without the interpreter.

Tests that need other values either start a child process with the environment they want (the
usual way, since Triton's own choice is made at import) or call `reload_kernel_settings(env)`
with an explicit mapping; `loraplex.kernels.lora_configs.apply_settings()` then re-applies the table
overrides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

FP8_GEMMS = ("scaled_mm", "weight_only", "w8a8", "auto")  # LORAPLEX_FP8_GEMM values


@dataclass(frozen=True)
class KernelSettings:
    lora_configs: str | None = None
    """`LORAPLEX_LORA_CONFIGS`: path of a JSON file whose entries replace the LoRA kernels' block-size
    and K-split tables (format in `kernels/lora_configs.py`), e.g. what `python -m loraplex.bench.lora_kernels
    --joint-sweep` or `python -m loraplex.bench.decode_sweep` writes for another GPU or model shape.
    Empty: the built-in tables."""

    triton_interpret: bool = False
    """`TRITON_INTERPRET=1`: Triton runs kernels in its CPU interpreter (tests), so the Triton paths
    may serve CPU tensors (`loraplex.kernels.placement.run_triton_on_cpu`, `--lora-backend triton` on CPU)."""

    fp8_gemm: str = "auto"
    """`LORAPLEX_FP8_GEMM`: the GEMM of an FP8 base's linears on the GPU. `scaled_mm`: activations
    quantized per token, `torch._scaled_mm`, block-scaled checkpoints re-quantized per output channel
    at load. `weight_only`: `kernels/fp8_weight_gemm.py` for every batch (activations stay in
    `--dtype`, E4M3 weights dequantized in registers, block scales kept as the checkpoint has them).
    `w8a8`: the same file's W8A8 GEMM for every batch (activations quantized per token as for
    `scaled_mm`, an FP8 MMA, split-K). `auto` (default): per-channel weights as `scaled_mm` has them,
    and per linear and batch the GEMM that measured faster (`fp8_gemm_choice.fp8_gemm_kernel`: the
    measured choice per shape, else the W8A8 GEMM up to 256 rows and `torch._scaled_mm` above); its
    batch-64 Llama-3.1-8B-shaped decode step was 7.62 ms against 8.37 under `scaled_mm` (H100) and
    6.06 against 7.10 (H200), 2026-12-06."""

    fp8_gemm_configs: str | None = None
    """`LORAPLEX_FP8_GEMM_CONFIGS`: path of a JSON file of the Triton FP8 GEMMs' tile sizes and
    K-splits per (rows bucket, N, K, kernel), and `auto`'s GEMM per (rows bucket, N, K) (format in
    `kernels/fp8_gemm_configs.py`), e.g. what `python -m loraplex.bench.fp8_gemm` writes. Empty: the
    built-in tables and rules."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KernelSettings:
        fp8_gemm = env.get("LORAPLEX_FP8_GEMM") or "auto"
        if fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"LORAPLEX_FP8_GEMM={fp8_gemm!r}: one of {', '.join(FP8_GEMMS)}")
        return cls(
            lora_configs=env.get("LORAPLEX_LORA_CONFIGS") or None,
            triton_interpret=env.get("TRITON_INTERPRET") == "1",
            fp8_gemm=fp8_gemm,
            fp8_gemm_configs=env.get("LORAPLEX_FP8_GEMM_CONFIGS") or None,
        )


_current: list[KernelSettings] = []


def kernel_settings() -> KernelSettings:
    """The settings, read from the process environment on the first call."""
    if not _current:
        _current.append(KernelSettings.from_env(os.environ))
    return _current[0]


def reload_kernel_settings(env: Mapping[str, str] | None = None) -> KernelSettings:
    """Re-read the settings from `env` (default: the process environment) and return them."""
    _current[:] = [KernelSettings.from_env(os.environ if env is None else env)]
    return _current[0]
