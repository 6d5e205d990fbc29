"""How big the paged KV cache is, and allocating it."""

from __future__ import annotations

import logging
import os

import torch

from loraplex.services.inference.models.config import ModelConfig

log = logging.getLogger(__name__)

CPU_KV_BYTES_CAP = 512 << 20  # the CPU default never takes more than 512 MiB (or 10% of RAM)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def plan_num_blocks(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    page_size: int,
    context_length: int,
    max_running_requests: int,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    reserved_bytes: int = 0,
) -> int:
    """Blocks for the cache: forced by `max_total_tokens`, else from memory.

    On CUDA the static part of the device memory (weights + adapter pool + KV) is
    `mem_fraction_static` of the total; what weights and anything already allocated use is
    measured, and `reserved_bytes` covers allocations still to come (the LoRA pool when it
    is created after the cache). On CPU: enough for every running request at full context,
    capped at 512 MiB / 10% of RAM but never below one full context.
    """
    per_token = kv_bytes_per_token(cfg, dtype)
    if max_total_tokens is not None:
        tokens = max_total_tokens
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            check_forced_kv_budget(
                tokens, per_token, page_size, free, total, mem_fraction_static, reserved_bytes
            )
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * mem_fraction_static - (total - free) - reserved_bytes
        if budget < per_token * page_size:
            raise MemoryError(
                f"no GPU memory left for the KV cache (static budget {mem_fraction_static:.2f} of "
                f"{total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free); raise --mem-fraction-static "
                "or shrink the adapter pool"
            )
        tokens = int(budget // per_token)
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cap = min(CPU_KV_BYTES_CAP, ram // 10) // per_token
        tokens = max(min(max_running_requests * context_length, cap), context_length)
    num_blocks = max(1, tokens // page_size)
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
        num_blocks,
        page_size,
        num_blocks * page_size,
        num_blocks * page_size * per_token / 2**20,
    )
    return num_blocks


def largest_kv_tokens(
    per_token: int, page_size: int, free: int, total: int, mem_fraction_static: float, reserved_bytes: int
) -> int:
    """The most KV tokens (whole pages) that fit in `free` device bytes after `reserved_bytes` (the
    adapter pool still to come) and the headroom --mem-fraction-static leaves for activations and
    CUDA graphs, `(1 - mem_fraction_static) * total`."""
    room = free - reserved_bytes - int((1 - mem_fraction_static) * total)
    return max(room // per_token // page_size * page_size, 0)


def check_forced_kv_budget(
    tokens: int,
    per_token: int,
    page_size: int,
    free: int,
    total: int,
    mem_fraction_static: float,
    reserved_bytes: int,
) -> None:
    """Refuse a --max-total-tokens the device cannot hold, before allocating it (which would die
    with an out-of-memory traceback), naming the flag and the largest value that fits."""
    largest = largest_kv_tokens(per_token, page_size, free, total, mem_fraction_static, reserved_bytes)
    if tokens > largest:
        raise MemoryError(
            f"--max-total-tokens {tokens} needs {tokens * per_token / 2**30:.2f} GiB of KV cache, but with "
            f"{free / 2**30:.2f} GiB free of {total / 2**30:.1f} GiB, the adapter pool's "
            f"{reserved_bytes / 2**30:.2f} GiB and the {1 - mem_fraction_static:.2f} headroom "
            f"--mem-fraction-static {mem_fraction_static:.2f} leaves, the largest that fits is "
            f"--max-total-tokens {largest}"
        )


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[num_layers, 2 (k, v), num_blocks, page_size, kv_heads, head_dim]."""
    shape = (cfg.num_layers, 2, num_blocks, page_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
