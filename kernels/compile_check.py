"""Compile the LoRA (and their metadata), fused element-wise and base-step Triton kernels for an sm_90 GPU on
a machine without one.

Triton's CPU interpreter runs the kernels' Python, not the compiler, so it misses what only
the compiler refuses (a value retyped inside an if-block, say). `python -m loraplex.kernels.compile_check`
lowers each kernel to PTX and a cubin for `cuda:90` and prints one line per kernel; tests run it.
Each entry names every constexpr without a default. Run it with the GPU image's Triton too (its wheel
on PYTHONPATH: `pip install --no-deps --target DIR triton==3.6.0`): the two versions' compilers refuse
different things (3.6 failed on a while loop carrying a tensor that 3.9 compiles, in a kernel since removed).
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex.kernels.attention_decode import _decode_split_kernel
from loraplex.kernels.dora_scale import _dora_scale_kernel
from loraplex.kernels.expert_lora_pairs import _pair_lora_kernel
from loraplex.kernels.fused_ops import _add_rms_norm_kernel, _rms_norm_kernel, _silu_mul_kernel
from loraplex.kernels.lora_expand import _expand_kernel
from loraplex.kernels.lora_expand_token import _expand_token_kernel
from loraplex.kernels.lora_meta import _segments_kernel
from loraplex.kernels.lora_shrink import _shrink_kernel
from loraplex.kernels.moe_align import _moe_align_kernel
from loraplex.kernels.moe_grouped import _down_kernel, _gate_up_kernel
from loraplex.kernels.qkv_rotary import _qkv_rotary_kernel
from loraplex.kernels.skinny_gemm import _skinny_kernel

# Pointer arguments by name; other pointers are int32 metadata, other scalars int32.
POINTERS = {
    "x_ptr": "*bf16",
    "a_ptr": "*bf16",
    "b_ptr": "*bf16",
    "out_ptr": "*bf16",
    "y_ptr": "*fp32",
    "scal_ptr": "*fp32",
    "h_ptr": "*bf16",
    "h_out_ptr": "*bf16",
    "w_ptr": "*bf16",
    "d_ptr": "*fp32",
    "qkv_ptr": "*bf16",
    "cos_ptr": "*bf16",
    "sin_ptr": "*bf16",
    "q_ptr": "*bf16",
    "k_ptr": "*bf16",
    "v_ptr": "*bf16",
    "act_ptr": "*bf16",
    "delta_ptr": "*bf16",
    "weight_ptr": "*fp32",
    "experts_ptr": "*i64",
    # the base step's fused launches (issue 38): fused KV store, skinny gated GEMM, direct decode output
    "kc_ptr": "*bf16",
    "vc_ptr": "*bf16",
    "slots_ptr": "*i64",
    "bias_ptr": "*bf16",
    "part_ptr": "*fp32",
    "mid_o_ptr": "*bf16",
    "mid_lse_ptr": "*fp32",
    "slot_scale_ptr": "*fp32",
    "xq_ptr": "*fp8e4nv",
    "xs_ptr": "*fp32",
    "factor_ptr": "*fp32",  # DoRA's factor table
}
SCALARS = {
    "eps": "fp32",
    "scale_log2": "fp32",
    "scale": "fp32",
    "softcap": "fp32",
    "fp8_max": "fp32",
    "min_scale": "fp32",
}
COMMON = dict(PRECISION="tf32", BLOCK_M=16)
MOE_BLOCKS = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)
# The q/k/v split-and-rotary launch at Llama-3.1-8B's heads; + storing k/v into the cache.
QKV_LLAMA_8B = dict(Q_HEADS=32, KV_HEADS=8, HALF=64, BLOCK_H=32, BLOCK_D=64)
QKV_STORE = dict(QKV_LLAMA_8B, HAS_DELTA=False, QK_NORM=False, UNIT_OFFSET=False, STORE_KV=True, PAGE_SIZE=16)
KERNELS = {
    "shrink": (
        _shrink_kernel,
        dict(
            COMMON,
            R_BLOCKS=1,
            PAGE=8,
            STRIDE_BLOCK_TOKENS=128,
            EVEN_K=True,
            PDL=False,
            BLOCK_R=16,
            BLOCK_K=256,
        ),
    ),
    "shrink_pdl": (  # programmatic dependent launch (compute capability >= 9): the grid-dependency wait
        _shrink_kernel,
        dict(
            COMMON,
            R_BLOCKS=1,
            PAGE=8,
            STRIDE_BLOCK_TOKENS=128,
            EVEN_K=False,
            PDL=True,
            BLOCK_R=16,
            BLOCK_K=128,
        ),
    ),
    "expand_accumulate": (
        _expand_kernel,
        dict(
            COMMON,
            PAGE=8,
            N_SPLITS=2,
            STRIDE_BLOCK_TOKENS=128,
            EVEN_N=True,
            ACCUMULATE=True,
            PDL=True,
            BLOCK_N=256,
            BLOCK_R=16,
        ),
    ),
    "expand_delta": (
        _expand_kernel,
        dict(
            COMMON,
            PAGE=8,
            N_SPLITS=1,
            STRIDE_BLOCK_TOKENS=128,
            EVEN_N=False,
            ACCUMULATE=False,
            PDL=False,
            BLOCK_N=128,
            BLOCK_R=64,
        ),
    ),
    "expand_token_delta": (
        _expand_token_kernel,
        dict(PAGE=8, N_SPLITS=8, EVEN_N=True, ACCUMULATE=False, PDL=True, BLOCK_N=128, BLOCK_R=16),
    ),
    "expand_token_accumulate": (
        _expand_token_kernel,
        dict(PAGE=8, N_SPLITS=1, EVEN_N=False, ACCUMULATE=True, PDL=False, BLOCK_N=64, BLOCK_R=64),
    ),
    "add_rms_norm_delta": (_add_rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_DELTA=True, QUANT=False)),
    "silu_mul_delta": (_silu_mul_kernel, dict(N=14336, BLOCK=1024, HAS_DELTA=True, QUANT=False)),
    # An FP8 base's W8A8 GEMM input, quantized by the launch that makes it
    "add_rms_norm_quant": (_add_rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_DELTA=False, QUANT=True)),
    "rms_norm_quant": (_rms_norm_kernel, dict(N=4096, BLOCK=4096, UNIT_OFFSET=False, QUANT=True)),
    "silu_mul_quant": (
        _silu_mul_kernel,
        dict(N=14336, BLOCK=16384, HAS_DELTA=False, GELU_TANH=False, QUANT=True),
    ),
    "qkv_rotary_delta": (
        _qkv_rotary_kernel,
        dict(QKV_LLAMA_8B, HAS_DELTA=True, QK_NORM=False, UNIT_OFFSET=False, STORE_KV=False, KV_FP8=False),
    ),
    "segments": (
        _segments_kernel,
        dict(S=64, BLOCK_S=128, BLOCK_T=256, BLOCK_B=32, M0=16, M1=32, M2=64, M3=128),
    ),
    "qkv_rotary": (
        _qkv_rotary_kernel,
        dict(QKV_LLAMA_8B, HAS_DELTA=False, QK_NORM=False, UNIT_OFFSET=False, STORE_KV=False, KV_FP8=False),
    ),
    "qkv_rotary_store_kv": (_qkv_rotary_kernel, dict(QKV_STORE, KV_FP8=False)),
    "skinny_geglu_split_k": (  # a smaller model's gate_up: few column tiles, so K splits
        _skinny_kernel,
        dict(
            N=2048,
            K=4096,
            K_PER=1024,
            BLOCK_M=64,
            BLOCK_N=32,
            BLOCK_K=128,
            SPLIT_K=4,
            EVEN_K=True,
            HAS_BIAS=False,
            ACT=2,
            PRECISION="tf32",
        ),
    ),
    "skinny_silu": (
        _skinny_kernel,
        dict(
            N=14336,
            K=4096,
            K_PER=4096,
            BLOCK_M=16,
            BLOCK_N=32,
            BLOCK_K=128,
            SPLIT_K=1,
            EVEN_K=True,
            HAS_BIAS=True,
            ACT=1,
            PRECISION="tf32",
        ),
    ),
    "decode_split_direct": (
        _decode_split_kernel,
        dict(
            GROUP=4,
            GROUP_PAD=16,
            HEAD_DIM=128,
            BLOCK_D=128,
            PAGE_SIZE=16,
            BLOCK_N=32,
            SOFTCAP=False,
            DIRECT=True,
            KV_FP8=False,
            F16_DOT=False,
        ),
    ),
    "moe_gate_up": (_gate_up_kernel, dict(MOE_BLOCKS, GELU=False, HAS_DELTA=False, BLOCK_M=16)),
    "moe_down": (_down_kernel, dict(MOE_BLOCKS, HAS_DELTA=False)),
    "moe_gate_up_lora": (_gate_up_kernel, dict(MOE_BLOCKS, GELU=False, HAS_DELTA=True, BLOCK_M=16)),
    "moe_down_lora": (_down_kernel, dict(MOE_BLOCKS, HAS_DELTA=True)),
    "expert_pair_lora_r16": (_pair_lora_kernel, dict(RANK=16, R_P2=16, BLOCK_K=128, BLOCK_N=64)),
    "expert_pair_lora_r24": (_pair_lora_kernel, dict(RANK=24, R_P2=32, BLOCK_K=128, BLOCK_N=64)),
    "moe_align": (_moe_align_kernel, dict(E_P2=128, BLOCK_M=16, BLOCK_P=32)),
    "dora_scale": (_dora_scale_kernel, dict(HAS_DELTA=True, HAS_BIAS=True, BLOCK=1024)),
}


def compile_kernel(fn, constexprs: dict, arch: int = 90, pointers: dict[str, str] | None = None):
    """`fn` compiled for sm_`arch`; `pointers` overrides POINTERS' element types (an FP8 cache)."""
    names = fn.arg_names
    pointer_types = POINTERS | (pointers or {})
    signature = {
        n: "constexpr"
        if n in constexprs
        else pointer_types.get(n, "*i32")
        if n.endswith("_ptr")
        else SCALARS.get(n, "i32")
        for n in names
    }
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


def main() -> int:
    for name, (fn, constexprs) in KERNELS.items():
        kernel = compile_kernel(fn, constexprs)
        print(
            f"{name}: ptx {len(kernel.asm['ptx'])} chars, cubin {len(kernel.asm['cubin'])} bytes", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
