"""Turn the LoRA flags into a pool, a backend and a manager, with the startup adapters loaded.

Defaults (docs/architecture.md, "LoRA defaults"):
- `--max-lora-rank` / `--lora-target-modules` not given: inferred from `--lora-paths` (the
  largest rank, the union of targeted modules); with no `--lora-paths` either, rank 64 and all
  seven projections, so any common adapter can be loaded later without a restart.
- `--lora-backend`: triton on CUDA, torch on CPU.
- `--max-loras-per-batch` not given: the adapter pool is sized from memory (`pool_slots_from_memory`),
  at most `--max-gpu-loras` slots, and every resident adapter may share a batch. Given: the pool
  has exactly that many slots, so no batch holds more distinct adapters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.settings import kernel_settings
from services.inference.lora.adapter import read_config
from services.inference.lora.backend import LoRABackend
from services.inference.lora.config import resolve_targets
from services.inference.lora.manager import LoRAManager
from services.inference.lora.pool import AdapterPool, pool_nbytes
from services.inference.lora.shapes import ALL_MODULES, ModelShapes
from services.inference.server_args import ServerArgs

log = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 64
# Pool sizing when --max-loras-per-batch is not given: this share of the memory the KV cache
# would otherwise get (CUDA), or this many bytes of address space (CPU: allocated uninitialised,
# so slots never loaded cost no RAM), and at most this many slots unless --max-gpu-loras says.
POOL_MEMORY_SHARE = 0.10
CPU_POOL_BYTES = 1 << 30
DEFAULT_MAX_GPU_LORAS = {"cuda": 256, "cpu": 64}


@dataclass(frozen=True)
class LoRASettings:
    max_loras_per_batch: int  # pool slots = the most distinct adapters in one batch
    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loaded_loras: int | None
    backend: str  # "torch" | "triton"
    pool_sized_from_memory: bool = False  # --max-loras-per-batch not given


class LoRAStack(NamedTuple):
    settings: LoRASettings
    pool: AdapterPool
    backend: LoRABackend
    manager: LoRAManager


def parse_target_modules(names: Iterable[str]) -> tuple[str, ...]:
    """`--lora-target-modules` values ('all' or projection names) in canonical order."""
    wanted = set(names)
    if "all" in wanted:
        return ALL_MODULES
    unknown = sorted(wanted - set(ALL_MODULES))
    if unknown:
        raise ValueError(
            f"--lora-target-modules: unknown {', '.join(unknown)}; use names from "
            f"{' '.join(ALL_MODULES)} or 'all'"
        )
    if not wanted:
        raise ValueError("--lora-target-modules needs at least one module name, or 'all'")
    return tuple(m for m in ALL_MODULES if m in wanted)


def local_source(name: str, source: str) -> str | None:
    """The default source resolver: a local adapter directory, or None (left to the adapter store)."""
    return source if Path(source).is_dir() else None


def _local_paths(args: ServerArgs, resolve_source: Callable[[str, str], str | None]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, source in args.lora_path_map.items():
        path = resolve_source(name, source)
        if path is None:
            log.warning(
                "--lora-paths %s=%s is not a local directory: the server loads it through the adapter "
                "store, and it does not count toward the inferred --max-lora-rank/--lora-target-modules",
                name,
                source,
            )
        else:
            out[name] = path
    return out


def resolve_lora_settings(
    args: ServerArgs,
    shapes: ModelShapes,
    device: torch.device,
    resolve_source: Callable[[str, str], str | None] = local_source,
    dtype: torch.dtype | None = None,
) -> LoRASettings:
    """Apply the defaults and inference rules above; raise ValueError for unusable flags."""
    if args.max_loras_per_batch is not None and args.max_loras_per_batch < 1:
        raise ValueError(f"--max-loras-per-batch must be >= 1 (got {args.max_loras_per_batch})")
    if args.max_gpu_loras is not None and args.max_gpu_loras < 1:
        raise ValueError(f"--max-gpu-loras must be >= 1 (got {args.max_gpu_loras})")
    if args.max_loaded_loras is not None and args.max_loaded_loras < 1:
        raise ValueError(f"--max-loaded-loras must be >= 1 (got {args.max_loaded_loras})")
    ranks: list[int] = []
    modules: set[str] = set()
    for path in _local_paths(args, resolve_source).values():
        spec, _ = read_config(path)
        targets = resolve_targets(spec, shapes.num_layers)
        ranks.append(max(t.rank for t in targets.values()))
        modules |= {m for _, m in targets}
    max_rank = args.max_lora_rank or max(ranks, default=DEFAULT_MAX_LORA_RANK)
    if max_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1 (got {max_rank})")
    if args.lora_target_modules is not None:
        target_modules = parse_target_modules(args.lora_target_modules)
    else:
        target_modules = parse_target_modules(modules) if modules else ALL_MODULES
    backend = args.lora_backend or ("triton" if device.type == "cuda" else "torch")
    if backend == "triton" and device.type != "cuda" and not kernel_settings().triton_interpret:
        raise ValueError(
            "--lora-backend triton needs a CUDA device (or TRITON_INTERPRET=1); use torch on CPU"
        )
    if args.max_loras_per_batch is not None:
        slots, sized = args.max_loras_per_batch, False
    else:
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        slots, sized = pool_slots_from_memory(args, shapes, max_rank, target_modules, dtype, device), True
    return LoRASettings(slots, max_rank, target_modules, args.max_loaded_loras, backend, sized)


def pool_slots_from_memory(
    args: ServerArgs,
    shapes: ModelShapes,
    max_rank: int,
    target_modules: tuple[str, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Slots for a pool sized from memory: POOL_MEMORY_SHARE of what the static budget leaves after
    the weights (CUDA) or CPU_POOL_BYTES (CPU), capped by --max-gpu-loras (default per device)."""
    per_slot = pool_nbytes(shapes, 1, max_rank, target_modules, dtype)
    cap = args.max_gpu_loras or DEFAULT_MAX_GPU_LORAS.get(device.type, DEFAULT_MAX_GPU_LORAS["cpu"])
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = POOL_MEMORY_SHARE * max(total * args.mem_fraction_static - (total - free), 0)
    else:
        budget = CPU_POOL_BYTES
    return max(1, min(cap, int(budget // per_slot)))


def build_lora(
    args: ServerArgs,
    shapes: ModelShapes,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
    resolve_source: Callable[[str, str], str | None] = local_source,
) -> LoRAStack:
    """Allocate the pool (call before sizing the KV cache), pick the backend, load `--lora-paths`."""
    settings = resolve_lora_settings(args, shapes, device, resolve_source, dtype)
    pool = AdapterPool(
        shapes,
        slots=settings.max_loras_per_batch,
        max_rank=settings.max_lora_rank,
        target_modules=settings.target_modules,
        dtype=dtype,
        device=device,
    )
    if settings.backend == "triton":
        from services.inference.lora.triton_backend import TritonLoRABackend

        backend: LoRABackend = TritonLoRABackend(
            pool, max_tokens, side_stream=not args.disable_lora_side_stream
        )
    else:
        from services.inference.lora.torch_backend import TorchLoRABackend

        backend = TorchLoRABackend(pool)
    manager = LoRAManager(pool, max_loaded_loras=settings.max_loaded_loras)
    for name, path in _local_paths(args, resolve_source).items():
        manager.load_adapter(name, path)
    log.info(
        "LoRA adapter pool: %d bytes (%.1f MiB) = %d slots x rank %d over %s, %s, backend %s; %s",
        pool.nbytes,
        pool.nbytes / 2**20,
        pool.slots,
        pool.max_rank,
        ",".join(settings.target_modules),
        dtype,
        settings.backend,
        f"sized from memory (--max-gpu-loras {args.max_gpu_loras or 'default'}): every resident adapter "
        "may share a batch"
        if settings.pool_sized_from_memory
        else f"--max-loras-per-batch {settings.max_loras_per_batch}: at most that many distinct adapters per batch",
    )
    return LoRAStack(settings, pool, backend, manager)
