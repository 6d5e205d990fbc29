"""The kernels' environment settings, typed and read in one place.

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

LORA_FUSED_MODES = ("auto", "on", "off")
FP8_GEMMS = ("scaled_mm", "weight_only", "auto")  # LORAPLEX_FP8_GEMM values


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

    moe_kernel: str = "grouped"
    """`LORAPLEX_MOE_KERNEL`: how a mixture-of-experts layer runs its experts on CUDA. `grouped`: the
    Triton grouped GEMM over tokens sorted by expert (kernels/moe_grouped.py; no host sync, so MoE
    steps of any size capture in CUDA graphs); `torch`: models/moe.py's torch paths (every expert
    dense up to 64 tokens, sorted with a host sync above; graphs only for decode batches <= 64).
    The CPU always runs the torch paths. Grouped is the default since its whole-model decode step
    passed bench/moe.py's check on the H100 (within twice the torch-vs-torch control) at 27.4 ms
    against torch's 33.5 ms (Qwen3-30B-A3B shape, batch 64, docs/benchmarks.md)."""

    lora_fused: str = "auto"
    """`LORAPLEX_LORA_FUSED=auto|on|off`: each LoRA group's shrink and expand as one launch with the
    rank-r intermediate on chip (`kernels/lora_fused.py`). auto: for steps of at most 256 tokens whose
    group has a measured `FUSED_TABLE` entry (`kernels/lora_configs.py`); on: every step; off: never."""

    # The base decode step (issue 38), each off until measured faster on the GPU (bench/base_step.py).
    skinny_gemm: bool = False
    """`LORAPLEX_SKINNY_GEMM=1`: the model's linears (and the LM head) over at most 64 rows run the
    Triton skinny GEMM of `kernels/skinny_gemm.py` instead of cuBLAS."""

    skinny_silu: bool = False
    """`LORAPLEX_SKINNY_SILU=1`: with no LoRA delta pending, the gate_up projection over at most 64
    rows and its SiLU-and-mul run as one skinny GEMM launch with the activation in its epilogue."""

    fused_kv_store: bool = False
    """`LORAPLEX_FUSED_KV_STORE=1`: the q/k/v split-and-rotary launch writes the new K/V rows straight
    into the paged cache (no separate store launch); an FP8 cache keeps the separate store."""

    decode_direct: bool = False
    """`LORAPLEX_DECODE_DIRECT=1`: a decode attention launch with a single split writes the final
    output itself (no merge launch)."""

    fp8_gemm: str = "scaled_mm"
    """`LORAPLEX_FP8_GEMM`: the GEMM of an FP8 base's linears on the GPU. `scaled_mm` (default):
    activations quantized per token, `torch._scaled_mm`, block-scaled checkpoints re-quantized per
    output channel at load. `weight_only`: `kernels/fp8_weight_gemm.py` for every batch (activations
    stay in `--dtype`, E4M3 weights dequantized in registers, block scales kept as the checkpoint has
    them). `auto`: weight-only up to 64 rows (decode), `torch._scaled_mm` above (block-scaled
    checkpoints keep their block scales and take the weight-only GEMM for every batch)."""

    fp8_gemm_configs: str | None = None
    """`LORAPLEX_FP8_GEMM_CONFIGS`: path of a JSON file of the weight-only FP8 GEMM's tile sizes and
    K-splits per (rows bucket, N, K) (format in `kernels/fp8_gemm_configs.py`), e.g. what
    `python -m loraplex.bench.fp8_gemm` writes. Empty: the built-in rule."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KernelSettings:
        fused = (env.get("LORAPLEX_LORA_FUSED") or "auto").strip().lower()
        if fused not in LORA_FUSED_MODES:
            raise ValueError(
                f"LORAPLEX_LORA_FUSED must be one of {', '.join(LORA_FUSED_MODES)} (got {fused!r})"
            )
        fp8_gemm = env.get("LORAPLEX_FP8_GEMM") or "scaled_mm"
        if fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"LORAPLEX_FP8_GEMM={fp8_gemm!r}: one of {', '.join(FP8_GEMMS)}")
        return cls(
            lora_configs=env.get("LORAPLEX_LORA_CONFIGS") or None,
            triton_interpret=env.get("TRITON_INTERPRET") == "1",
            moe_kernel=_choice(env, "LORAPLEX_MOE_KERNEL", ("grouped", "torch")),
            lora_fused=fused,
            skinny_gemm=env.get("LORAPLEX_SKINNY_GEMM") == "1",
            skinny_silu=env.get("LORAPLEX_SKINNY_SILU") == "1",
            fused_kv_store=env.get("LORAPLEX_FUSED_KV_STORE") == "1",
            decode_direct=env.get("LORAPLEX_DECODE_DIRECT") == "1",
            fp8_gemm=fp8_gemm,
            fp8_gemm_configs=env.get("LORAPLEX_FP8_GEMM_CONFIGS") or None,
        )


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """`env[name]` if one of `allowed` (the first is the default when unset), else ValueError."""
    value = env.get(name) or allowed[0]
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


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
