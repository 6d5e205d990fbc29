"""How big the paged KV cache is, allocating it, and the per-layer scales of an FP8 cache."""

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
    activation_dtype: torch.dtype | None = None,
) -> int:
    """Blocks for the cache: forced by `max_total_tokens`, else from memory.

    On CUDA the static part of the device memory (weights + adapter pool + KV) is
    `mem_fraction_static` of the total; what weights and anything already allocated use is
    measured, and `reserved_bytes` covers allocations still to come (the LoRA pool when it
    is created after the cache). On CPU: enough for every running request at full context,
    capped at 512 MiB / 10% of RAM but never below one full context. With `activation_dtype` unlike
    `dtype` (an FP8 cache), the blocks the activation dtype would get are logged beside (the gain).
    """
    sizing = dict(
        page_size=page_size,
        context_length=context_length,
        max_running_requests=max_running_requests,
        max_total_tokens=max_total_tokens,
        mem_fraction_static=mem_fraction_static,
        reserved_bytes=reserved_bytes,
    )
    num_blocks = _plan_blocks(cfg, dtype, device, **sizing)
    per_token = kv_bytes_per_token(cfg, dtype)
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)",
        num_blocks,
        page_size,
        num_blocks * page_size,
        num_blocks * page_size * per_token / 2**20,
    )
    if activation_dtype is not None and activation_dtype != dtype:
        plain = _plan_blocks(cfg, activation_dtype, device, **sizing)
        log.info(
            "KV cache %s: %.1fx the blocks of %s (%d blocks, against %d)",
            dtype_name(dtype),
            num_blocks / plain,
            dtype_name(activation_dtype),
            num_blocks,
            plain,
        )
    return num_blocks


def dtype_name(dtype: torch.dtype) -> str:
    return {
        torch.float8_e4m3fn: "fp8",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
    }.get(dtype, str(dtype).removeprefix("torch."))


def _plan_blocks(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    page_size: int,
    context_length: int,
    max_running_requests: int,
    max_total_tokens: int | None,
    mem_fraction_static: float,
    reserved_bytes: int,
) -> int:
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
    return max(1, tokens // page_size)


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


class KVCacheScales:
    """Per-layer scales of an FP8 (E4M3) KV cache: the cache holds `round(x / scale)` and reads
    back `cached * scale`, one scale for K and one for V per layer (`scale` `[num_layers, 2]`).

    The default is 1.0 everywhere: E4M3 spans +-448 with 3 mantissa bits at every magnitude from
    2^-6 up, and the K (after the projection and rotary) and V of real models sit far inside that
    range (docs/operations.md, "--kv-cache-dtype"), so an unscaled cast loses only the mantissa
    bits, as vLLM's and SGLang's uncalibrated FP8 caches do. Calibrated scales plug in with
    `load_`. The kernels read both tensors through pointers, so a captured CUDA graph sees new
    values; the store multiplies by `inv` (1 / scale, computed once here) so that it is bit-exact
    with torch's own rounding (kernels/attention_kv_store.py)."""

    def __init__(self, num_layers: int, device: torch.device):
        # Each value padded to 16 bytes: Triton specialises a pointer argument on 16-byte alignment,
        # so packed scalars would compile a kernel variant for every other layer.
        padded = torch.ones((2, num_layers, 2, 4), dtype=torch.float32, device=device)
        self.scale, self.inv = padded[0, ..., 0], padded[1, ..., 0]  # [num_layers, 2] views
        # One-element views per layer, made once: (k scale, v scale, k inverse, v inverse).
        self.layers = [
            (padded[0, i, 0, :1], padded[0, i, 1, :1], padded[1, i, 0, :1], padded[1, i, 1, :1])
            for i in range(num_layers)
        ]

    def load_(self, scales: torch.Tensor) -> None:
        """Calibrated `[num_layers, 2]` (k, v) scales, copied into the buffers in place."""
        scales = scales.to(device=self.scale.device, dtype=torch.float32)
        if scales.shape != self.scale.shape or not bool(((scales > 0) & scales.isfinite()).all()):
            raise ValueError(f"KV cache scales must be {tuple(self.scale.shape)}, positive and finite")
        self.scale.copy_(scales)
        self.inv.copy_(1.0 / scales)


def kv_cache_scales(kv_cache: torch.Tensor, given: KVCacheScales | None = None) -> KVCacheScales | None:
    """The scales an attention object over `kv_cache` `[num_layers, 2, ...]` uses: `given`, or unit
    scales, for an FP8 cache; None for a cache in a float dtype (which holds values unscaled)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return None
    return given or KVCacheScales(kv_cache.shape[0], kv_cache.device)
