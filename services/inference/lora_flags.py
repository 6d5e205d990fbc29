"""The LoRA flags of `python -m loraplex.services.inference` (`LoRAConfig`'s fields) and their help.

server_flags.py adds them to the parser in their place among the other flags; their defaults come
from `LoRAConfig` (lora/settings.py), read without building one.
"""

from __future__ import annotations

import argparse

from loraplex.services.inference.lora.settings import (
    CPU_LORA_MEMORY_FRACTION,
    DEFAULT_MAX_GPU_LORAS,
    DEFAULT_MAX_LORA_RANK,
    EXPERT_LORA_MODES,
    LORA_BACKENDS,
    LORA_MEMORY,
)


def add_lora_flags(parser: argparse.ArgumentParser, lo: argparse.Namespace) -> None:
    """`--lora-paths` .. `--lora-rotation-quantum`, defaults from `lo` (LoRAConfig's field defaults)."""
    a = parser.add_argument
    a(
        "--lora-paths",
        nargs="*",
        default=list(lo.lora_paths),
        metavar="NAME=SOURCE",
        help="adapters to load at start (local PEFT directories; other sources via the adapter store)",
    )
    a(
        "--max-loras-per-batch",
        type=int,
        default=lo.max_loras_per_batch,
        help="at most this many distinct adapters compute in one step: hot adapters keep places while "
        "they have requests, the others take short turns (docs/architecture.md); it never sizes the GPU "
        "pool (see --max-gpu-loras), so adapters stay resident between turns. Default: every resident "
        "adapter may share a step. The base model takes no place",
    )
    a(
        "--max-gpu-loras",
        type=int,
        default=lo.max_gpu_loras,
        help="upper bound on the adapter slots of the GPU pool, which is sized from memory; default "
        f"{DEFAULT_MAX_GPU_LORAS['cuda']} on CUDA, "
        f"{DEFAULT_MAX_GPU_LORAS['cpu']} on CPU",
    )
    a(
        "--lora-backend",
        default=lo.lora_backend,
        choices=LORA_BACKENDS,
        help="default: triton on CUDA, torch on CPU",
    )
    a(
        "--max-lora-rank",
        type=int,
        default=lo.max_lora_rank,
        help="largest adapter rank the pool holds; default: the largest rank in --lora-paths, "
        f"else {DEFAULT_MAX_LORA_RANK}",
    )
    a(
        "--lora-target-modules",
        nargs="*",
        default=lo.lora_target_modules,
        help="q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or 'all'; on a mixture-of-experts "
        "base also experts.gate_up_proj experts.down_proj (not in 'all'); default: the union of "
        "--lora-paths' targets, else all",
    )
    a(
        "--expert-lora-mode",
        choices=EXPERT_LORA_MODES,
        default=lo.expert_lora_mode,
        help="LoRA on the experts: auto (graphs on CUDA where it fits: bfloat16, a max rank that is a "
        "multiple of 8; else grouped), grouped (a grouped GEMM per adapter at its own rank), span (one "
        "over the step's adapters at their largest rank), loop (per adapter and expert), graphs (no "
        "host read: CUDA graphs stay on; decode steps take a per-pair Triton kernel); the others turn "
        "CUDA graphs off",
    )
    a(
        "--disable-lora-side-stream",
        action="store_true",
        default=lo.disable_lora_side_stream,
        help="triton backend: run decode steps' LoRA kernels after each base matmul on one stream, "
        "instead of beside it on a second stream (the default on CUDA)",
    )
    a(
        "--lora-memory",
        choices=LORA_MEMORY,
        default=lo.lora_memory,
        help="where the adapter pool's rank pages live: separate (their own memory, a share sized at "
        "start) or unified (inside the KV cache's blocks, one free list: adapters grow into memory the "
        "KV cache is not using and go back to the host tier when it needs it)",
    )
    a(
        "--max-loaded-loras",
        type=int,
        default=lo.max_loaded_loras,
        help="adapters kept in host memory (LRU beyond it, re-read from source); default unbounded. "
        "Combines with --max-cpu-lora-bytes: a copy goes when either bound is exceeded",
    )
    a(
        "--max-cpu-lora-bytes",
        type=int,
        default=lo.max_cpu_lora_bytes,
        help="bytes of adapter weights kept in host memory (pinned on CUDA), the tier below the GPU "
        "pool: LRU beyond it, re-read from source (disk cache) when next needed; copies a request or "
        f"a pin holds are kept regardless. Default {CPU_LORA_MEMORY_FRACTION:g} of the host memory "
        "available at start-up",
    )
    a(
        "--lora-slot-wait",
        type=float,
        default=lo.lora_slot_wait,
        help="seconds an adapter waits for a GPU slot to free by itself before a busy one is drained "
        "for it (its requests give the slot up and resume later, KV kept); default 0.05",
    )
    a(
        "--lora-rotation-quantum",
        type=float,
        default=lo.lora_rotation_quantum,
        help="seconds an adapter keeps a GPU slot it was uploaded into before the slot may be drained "
        "for another (the rotation's quantum; raise it for large adapters whose upload takes a good "
        "part of it); default 0.1",
    )
