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

    lora_pdl: bool | None = None
    """`LORAPLEX_LORA_PDL=1|0`: the LoRA shrink and expand launch with programmatic dependent launch
    on Hopper or newer, so the expand's programs start, and read their first B tile, while the shrink
    still runs (kernels/lora_expand.py). Unset: on for CUDA devices of compute capability >= 9, where
    `bench/lora_pdl.py` measured the layer's LoRA 2-9% faster, bit-identical (2026-12-05, H100)."""

    lora_handoff: bool | None = None
    """`LORAPLEX_LORA_HANDOFF=1|0`: a decode-sized step's LoRA shrink and expand per group as one
    launch (`kernels/lora_handoff.py`): the expand's programs wait on counters for the shrink's
    partials instead of a kernel boundary. Unset: off (not yet measured faster on a GPU)."""

    fp8_pdl: bool | None = None
    """`LORAPLEX_FP8_PDL=1|0`: the W8A8 FP8 GEMM launches with programmatic dependent launch after its
    activation-quantize launch (Hopper or newer), so its launch and set-up overlap the quantization
    (kernels/fp8_weight_gemm.py). `1` on for CUDA devices of compute capability >= 9; unset or `0`:
    off, as `bench/fp8_step.py` timed the batch-64 FP8 step 1.031x slower with it (H100, 2026-12-06)."""

    fp8_fused_quant: bool | None = None
    """`LORAPLEX_FP8_FUSED_QUANT=1|0`: where the W8A8 FP8 GEMM serves a linear (`LORAPLEX_FP8_GEMM`),
    the RMSNorm before q/k/v and gate/up and the SiLU-and-mul before down also write their output
    quantized per token, in the same launch, instead of a quantization launch before each of those
    GEMMs (96 fewer launches a Llama-3.1-8B step; its batch-64 FP8 step 7.25 against 7.44 ms, H100,
    `bench/fp8_step.py`, 2026-12-06). Unset: on for CUDA tensors."""

    # The base decode step (issue 38). Unset (None): on for CUDA tensors, where bench/base_step.py measured
    # them faster together (2026-12-05, H100: with cuBLASLt, 8.90 against 9.10 ms, docs/benchmarks.md),
    # off elsewhere (the CPU tests' interpreter). "1" / "0" force them on or off, the interpreter included.
    skinny_gemm: bool = False
    """`LORAPLEX_SKINNY_GEMM=1`: the model's linears (and the LM head) over at most 64 rows run the
    Triton skinny GEMM of `kernels/skinny_gemm.py` instead of cuBLAS (off: slower than cuBLAS on
    every projection but the LM head)."""

    skinny_silu: bool | None = None
    """`LORAPLEX_SKINNY_SILU=1|0`: with no LoRA delta pending, the gate_up projection over at most 64
    rows and its SiLU-and-mul run as one skinny GEMM launch with the activation in its epilogue."""

    fused_kv_store: bool | None = None
    """`LORAPLEX_FUSED_KV_STORE=1|0`: the q/k/v split-and-rotary launch writes the new K/V rows straight
    into the paged cache (no separate store launch), an FP8 cache's scaled E4M3 bytes included."""

    decode_direct: bool | None = None
    """`LORAPLEX_DECODE_DIRECT=1|0`: a decode attention launch with a single split writes the final
    output itself (no merge launch)."""

    blas: str = "cublaslt"
    """`LORAPLEX_BLAS=cublaslt|cublas`: torch's BLAS library for the matmuls on CUDA, set when a model
    runner is built. cuBLASLt's decode GEMMs measured faster than cuBLAS's at every batch and LoRA mix
    timed (docs/benchmarks.md, 2026-12-03 and 2026-12-05), never slower."""

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
        fused = (env.get("LORAPLEX_LORA_FUSED") or "auto").strip().lower()
        if fused not in LORA_FUSED_MODES:
            raise ValueError(
                f"LORAPLEX_LORA_FUSED must be one of {', '.join(LORA_FUSED_MODES)} (got {fused!r})"
            )
        fp8_gemm = env.get("LORAPLEX_FP8_GEMM") or "auto"
        if fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"LORAPLEX_FP8_GEMM={fp8_gemm!r}: one of {', '.join(FP8_GEMMS)}")
        return cls(
            lora_configs=env.get("LORAPLEX_LORA_CONFIGS") or None,
            triton_interpret=env.get("TRITON_INTERPRET") == "1",
            moe_kernel=_choice(env, "LORAPLEX_MOE_KERNEL", ("grouped", "torch")),
            lora_fused=fused,
            lora_pdl=_on_off(env, "LORAPLEX_LORA_PDL"),
            lora_handoff=_on_off(env, "LORAPLEX_LORA_HANDOFF"),
            fp8_pdl=_on_off(env, "LORAPLEX_FP8_PDL"),
            fp8_fused_quant=_on_off(env, "LORAPLEX_FP8_FUSED_QUANT"),
            skinny_gemm=env.get("LORAPLEX_SKINNY_GEMM") == "1",
            skinny_silu=_on_off(env, "LORAPLEX_SKINNY_SILU"),
            fused_kv_store=_on_off(env, "LORAPLEX_FUSED_KV_STORE"),
            decode_direct=_on_off(env, "LORAPLEX_DECODE_DIRECT"),
            blas=_choice(env, "LORAPLEX_BLAS", ("cublaslt", "cublas")),
            fp8_gemm=fp8_gemm,
            fp8_gemm_configs=env.get("LORAPLEX_FP8_GEMM_CONFIGS") or None,
        )


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """`env[name]` if one of `allowed` (the first is the default when unset), else ValueError."""
    value = env.get(name) or allowed[0]
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def _on_off(env: Mapping[str, str], name: str) -> bool | None:
    """`1` on, `0` off, unset or empty None (the field's own default: on for CUDA tensors)."""
    value = (env.get(name) or "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 or 0 (unset: on for CUDA tensors)")
    return None if value == "" else value == "1"


def switched_on(option: bool | None, on_cuda: bool) -> bool:
    """Whether an on/off option with an auto default applies to a tensor (`on_cuda`: it lives on CUDA)."""
    return on_cuda if option is None else option


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
