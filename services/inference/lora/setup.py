"""Turn the LoRA flags into a pool, a backend and a manager, with the startup adapters loaded.

Defaults (docs/architecture.md, "LoRA defaults"):
- `--max-lora-rank` / `--lora-target-modules` not given: inferred from `--lora-paths` (the
  largest rank, the union of targeted modules); with no `--lora-paths` either, rank 64 and all
  seven projections, so any common adapter can be loaded later without a restart.
- `--lora-backend`: triton on CUDA, torch on CPU.
- The adapter pool is sized from memory (`pool_size_from_memory`): its pages of rank rows bound
  the bytes, `--max-gpu-loras` bounds the slots (the resident adapters).
  `--max-loras-per-batch` never sizes it: it caps the distinct adapters of one step, which the
  scheduler applies (engine/adapter_slices.py), so an adapter left out of a step stays resident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from loraplex.services.inference.lora.adapter_files import read_config
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.lora.config import resolve_targets
from loraplex.services.inference.lora.dora import BaseWeight
from loraplex.services.inference.lora.expert_lora import ExpertLoRA, ExpertLoRAPool, expert_modules
from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
from loraplex.services.inference.lora.expert_targets import resolve_expert_targets
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.pool_layout import (
    default_pages,
    page_nbytes,
    pages_for_rank,
    pool_nbytes,
)
from loraplex.services.inference.lora.settings import (
    DEFAULT_MAX_GPU_LORAS,
    DEFAULT_MAX_LORA_RANK,
    LoRAConfig,
    LoRASettings,
    check_backend_device,
    default_cpu_lora_bytes,
    parse_target_modules,
)
from loraplex.services.inference.lora.shapes import ALL_MODULES, EXPERT_MODULES, ModelShapes

log = logging.getLogger(__name__)

# Pool sizing when --max-loras-per-batch is not given: this share of the memory the KV cache
# would otherwise get (CUDA), or this many bytes of address space (CPU: allocated uninitialised,
# so slots never loaded cost no RAM), and at most --max-gpu-loras slots.
POOL_MEMORY_SHARE = 0.10
CPU_POOL_BYTES = 1 << 30


class LoRAStack(NamedTuple):
    settings: LoRASettings
    pool: AdapterPool
    backend: LoRABackend
    manager: LoRAManager


def local_source(name: str, source: str) -> str | None:
    """The default source resolver: a local adapter directory, or None (left to the adapter store)."""
    return source if Path(source).is_dir() else None


def _local_paths(lora: LoRAConfig, resolve_source: Callable[[str, str], str | None]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, source in lora.path_map.items():
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
    lora: LoRAConfig,
    shapes: ModelShapes,
    device: torch.device,
    resolve_source: Callable[[str, str], str | None] = local_source,
    dtype: torch.dtype | None = None,
    *,
    mem_fraction_static: float,
) -> LoRASettings:
    """Apply the defaults and inference rules above; raise ValueError for unusable flags.

    `mem_fraction_static`: the engine's static memory share, which a pool sized from memory on
    CUDA takes its part of (pass `EngineConfig.mem_fraction_static`)."""
    ranks: list[int] = []
    modules: set[str] = set()
    for path in _local_paths(lora, resolve_source).values():
        spec, _ = read_config(path)
        targets = {**resolve_targets(spec, shapes.num_layers, shapes.hf_modules)}
        targets.update(resolve_expert_targets(spec, shapes))
        if targets:  # none: an adapter of the embedding / lm_head only (its own rank, not the pool's)
            ranks.append(max(t.rank for t in targets.values()))
        modules |= {m for _, m in targets}
    max_rank = lora.max_lora_rank or max(ranks, default=DEFAULT_MAX_LORA_RANK)
    if lora.lora_target_modules is not None:
        target_modules = parse_target_modules(lora.lora_target_modules)
    else:
        target_modules = parse_target_modules(modules) if modules else ALL_MODULES
    # A mixture-of-experts base: LoRA reaches attention and the experts (lora/expert_lora.py), whose
    # buffers are allocated only when named or needed by a --lora-paths adapter.
    servable = shapes.hf_modules + EXPERT_MODULES if shapes.moe else ALL_MODULES
    beyond = [m for m in target_modules if m not in servable]
    if lora.lora_target_modules is not None and beyond:
        raise ValueError(
            f"--lora-target-modules {' '.join(beyond)}: "
            + (
                f"this mixture-of-experts base serves LoRA on {', '.join(servable)}"
                if shapes.moe
                else "this base has no experts"
            )
        )
    target_modules = tuple(m for m in target_modules if m in servable)
    backend = lora.lora_backend or ("triton" if device.type == "cuda" else "torch")
    check_backend_device(backend, device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    slots, pages = pool_size_from_memory(
        lora, shapes, max_rank, target_modules, dtype, device, mem_fraction_static
    )
    if lora.lora_memory == "unified":
        # The pages sized from memory are the pool's guaranteed share of the KV cache's blocks; more
        # adapters stay resident in blocks the cache is not using, up to the slots.
        slots = lora.max_gpu_loras or DEFAULT_MAX_GPU_LORAS.get(device.type, DEFAULT_MAX_GPU_LORAS["cpu"])
    cap = lora.max_loras_per_batch
    if cap is not None and cap > slots:
        log.warning(
            "--max-loras-per-batch %d is more than the %d adapter slots memory allows: a step holds at "
            "most %d distinct adapters",
            cap,
            slots,
            slots,
        )
    host_bytes = lora.max_cpu_lora_bytes or default_cpu_lora_bytes()
    timings = tuple(
        (name, seconds)
        for name, seconds in (
            ("slot_wait_s", lora.lora_slot_wait),
            ("min_resident_s", lora.lora_rotation_quantum),
        )
        if seconds is not None
    )
    return LoRASettings(
        slots, max_rank, target_modules, lora.max_loaded_loras, backend, cap, host_bytes, timings, pages
    )


def pool_size_from_memory(
    lora: LoRAConfig,
    shapes: ModelShapes,
    max_rank: int,
    target_modules: tuple[str, ...],
    dtype: torch.dtype,
    device: torch.device,
    mem_fraction_static: float,
) -> tuple[int, int]:
    """(slots, pages) of a pool sized from memory: POOL_MEMORY_SHARE of what the static budget leaves
    after the weights (CUDA) or CPU_POOL_BYTES (CPU), in pages (lora/pool.py: at most enough for every
    slot to hold a max-rank adapter, at least one such adapter); slots: --max-gpu-loras (default per
    device), fewer only where the pages could not give each slot one page."""
    cap = lora.max_gpu_loras or DEFAULT_MAX_GPU_LORAS.get(device.type, DEFAULT_MAX_GPU_LORAS["cpu"])
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = POOL_MEMORY_SHARE * max(total * mem_fraction_static - (total - free), 0)
    else:
        budget = CPU_POOL_BYTES
    per_page = page_nbytes(shapes, max_rank, target_modules, dtype)
    per_slot = pool_nbytes(shapes, 1, max_rank, target_modules, dtype, num_pages=0)  # tables (+ experts)
    one_adapter = pages_for_rank(max_rank, max_rank)
    if per_page == 0 or expert_modules(target_modules):
        # The experts' buffers are per slot (lora/expert_lora.py): slots sized as before, every slot's pages.
        slots = max(1, min(cap, int(budget // pool_nbytes(shapes, 1, max_rank, target_modules, dtype))))
        return slots, default_pages(slots, max_rank)
    # The slot tables of `cap` slots first (kilobytes), the pages from the rest.
    pages = int(max(budget - cap * per_slot, 0) // per_page)
    pages = max(one_adapter, min(pages, default_pages(cap, max_rank)))
    return max(1, min(cap, pages)), pages


def build_lora(
    lora: LoRAConfig,
    shapes: ModelShapes,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
    mem_fraction_static: float,
    resolve_source: Callable[[str, str], str | None] = local_source,
    base_weight: BaseWeight | None = None,
) -> LoRAStack:
    """Allocate the pool (call before sizing the KV cache), pick the backend, load `--lora-paths`.
    `base_weight`: the model's projection rows, for DoRA adapters (lora/dora.py; None refuses them)."""
    settings = resolve_lora_settings(
        lora, shapes, device, resolve_source, dtype, mem_fraction_static=mem_fraction_static
    )
    unified = lora.lora_memory == "unified"
    if unified and expert_modules(settings.target_modules):
        raise ValueError(
            "--lora-memory unified: LoRA on the experts keeps per-slot buffers; serve expert adapters "
            "with --lora-memory separate"
        )
    pool = AdapterPool(
        shapes,
        slots=settings.pool_slots,
        max_rank=settings.max_lora_rank,
        target_modules=settings.target_modules,
        dtype=dtype,
        device=device,
        num_pages=settings.pool_pages,
        external_pages=unified,
    )
    if unified:  # the pages come with the KV cache (engine/unified_blocks.py); this is their share
        pool.guaranteed_pages = pool.pages_per_slot if settings.pool_pages is None else settings.pool_pages
    if settings.backend == "triton":
        from loraplex.services.inference.lora.triton_backend import TritonLoRABackend

        backend: LoRABackend = TritonLoRABackend(
            pool, max_tokens, side_stream=not lora.disable_lora_side_stream
        )
    else:
        from loraplex.services.inference.lora.torch_backend import TorchLoRABackend

        backend = TorchLoRABackend(pool)
    backend.step_distinct_cap = settings.max_loras_per_batch
    if pool.experts is not None:
        mode = expert_lora_mode(lora.expert_lora_mode, pool.experts)
        backend.experts = (
            GraphExpertLoRA(pool.experts)
            if mode == "graphs"
            else ExpertLoRA(pool.experts, grouped=False if mode == "loop" else None, span=mode == "span")
        )
    manager = LoRAManager(
        pool,
        max_loaded_loras=settings.max_loaded_loras,
        max_cpu_lora_bytes=settings.max_cpu_lora_bytes,
        max_loras_per_batch=settings.max_loras_per_batch,
        base_weight=base_weight,
        **dict(settings.slot_timings),
    )
    for name, path in _local_paths(lora, resolve_source).items():
        manager.load_adapter(name, path)
    log.info(
        "LoRA adapter pool: %d bytes (%.1f MiB) = %d pages of %d rank rows, %d slots up to rank %d over "
        "%s, %s, backend %s; %s",
        pool.nbytes,
        pool.nbytes / 2**20,
        pool.num_pages,
        pool.page_rows,
        pool.slots,
        pool.max_rank,
        ",".join(settings.target_modules),
        dtype,
        settings.backend,
        f"sized from memory (--max-gpu-loras {lora.max_gpu_loras or 'default'}); "
        + (
            "every resident adapter may share a step"
            if settings.max_loras_per_batch is None
            else f"--max-loras-per-batch {settings.max_loras_per_batch}: at most that many distinct "
            "adapters per step, taking turns (resident adapters stay resident)"
        ),
    )
    return LoRAStack(settings, pool, backend, manager)


def expert_lora_mode(asked: str, pool: ExpertLoRAPool) -> str:
    """`--expert-lora-mode auto`: on CUDA the graphs mode where it fits the pool (decode CUDA graphs
    stay on, and decode steps take the per-pair kernel: 0.86x the base step on the H100 at batch 64
    over 8 adapters, against 0.21x for the eager grouped mode), else grouped. The CPU keeps grouped."""
    if asked != "auto":
        return asked
    on_cuda = next(iter(pool.a.values())).device.type == "cuda"
    mode = "graphs" if on_cuda and GraphExpertLoRA.fits(pool) else "grouped"
    log.info("LoRA on the experts: --expert-lora-mode auto chose %s", mode)
    return mode
