"""Child process of tests/integration/test_fp8_kv.py: the FP8 KV cache variants of the store, paged
decode and paged prefill kernels compile for an sm_90 GPU (the interpreter never runs the
compiler), as kernels/compile_check.py does for the LoRA kernels. Prints one line per kernel with
what the PTX shows: the store has no division (its rounding is bit-exact integer work) and the
attention kernels convert E4M3 with the hardware's cvt instructions.
"""

from __future__ import annotations

import sys

from loraplex.kernels.attention_decode import _decode_split_kernel
from loraplex.kernels.attention_kv_store import _store_kv_kernel
from loraplex.kernels.attention_prefill import _prefill_kernel
from loraplex.kernels.compile_check import QKV_STORE, compile_kernel
from loraplex.kernels.qkv_rotary import _qkv_rotary_kernel

SCALES = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
FP8_CACHE = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "q_ptr": "*bf16"}
KERNELS = {
    "store_kv_fp8": (
        _store_kv_kernel,
        {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "slots_ptr": "*i64"}
        | {"k_inv_scale_ptr": "*fp32", "v_inv_scale_ptr": "*fp32"},
        dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, PAGE_SIZE=16, FP8=True),
    ),
    "decode_fp8": (
        _decode_split_kernel,
        FP8_CACHE | SCALES | {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"},
        dict(
            GROUP=4,
            GROUP_PAD=16,
            HEAD_DIM=128,
            BLOCK_D=128,
            PAGE_SIZE=16,
            BLOCK_N=64,
            SOFTCAP=False,
            KV_FP8=True,
            F16_DOT=True,
        ),
    ),
    "qkv_rotary_store_fp8": (
        _qkv_rotary_kernel,
        {"kc_ptr": "*u8", "vc_ptr": "*u8", "k_inv_ptr": "*fp32", "v_inv_ptr": "*fp32"},
        dict(QKV_STORE, KV_FP8=True),
    ),
    "prefill_fp8_softcap": (
        _prefill_kernel,
        FP8_CACHE | SCALES | {"out_ptr": "*bf16"},
        dict(
            GROUP=4,
            HEAD_DIM=128,
            BLOCK_D=128,
            PAGE_SIZE=16,
            BLOCK_M=64,
            BLOCK_N=64,
            SOFTCAP=True,
            KV_FP8=True,
        ),
    ),
}


def main() -> int:
    for name, (fn, pointers, constexprs) in KERNELS.items():
        ptx = compile_kernel(fn, constexprs, pointers=pointers).asm["ptx"]
        print(
            f"{name}: ptx {len(ptx)} chars, div {ptx.count('div.')}, e4m3 cvt {ptx.count('e4m3')}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
