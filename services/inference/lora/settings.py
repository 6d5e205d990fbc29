"""The LoRA flags (`LoRAConfig`, which owns their defaults) and what they resolve to once the
model and device are known (`LoRASettings`, which travels to tensor-parallel workers).

`lora/setup.py` applies the rules that turn one into the other (docs/architecture.md,
"LoRA defaults").
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loraplex.kernels.settings import kernel_settings
from loraplex.services.inference.lora.names import ADAPTER_NAME_RULE, is_adapter_name
from loraplex.services.inference.lora.shapes import ALL_MODULES, EXPERT_MODULES, FUSED_MODULES

LORA_BACKENDS = ("triton", "torch")
# How LoRA on the experts is computed (lora/expert_lora.py): grouped_mm per slot at its own rank
# (loop where torch has no grouped_mm), one grouped_mm over the step's slot span, the loop, or with no
# host read (lora/expert_lora_graph.py); auto picks graphs or grouped (lora/setup.py expert_lora_mode).
EXPERT_LORA_MODES = ("auto", "grouped", "span", "loop", "graphs")
# `--max-lora-rank` when neither it nor a local `--lora-paths` adapter gives one.
DEFAULT_MAX_LORA_RANK = 64
# `--max-gpu-loras` when not given: the slot bound of a pool sized from memory, per device type.
DEFAULT_MAX_GPU_LORAS = {"cuda": 256, "cpu": 64}
# `--max-cpu-lora-bytes` when not given: this fraction of the host memory available at start-up.
CPU_LORA_MEMORY_FRACTION = 0.25


def available_host_bytes() -> int | None:
    """Host memory available now (Linux: MemAvailable, else free pages); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def default_cpu_lora_bytes() -> int | None:
    """The host tier's byte bound when `--max-cpu-lora-bytes` is not given (None: unbounded)."""
    avail = available_host_bytes()
    return int(avail * CPU_LORA_MEMORY_FRACTION) if avail else None


def parse_target_modules(names: Iterable[str]) -> tuple[str, ...]:
    """`--lora-target-modules` values ('all' or projection names) in canonical order. Phi-3's fused
    names stand for their parts (qkv_proj: q_proj k_proj v_proj; gate_up_proj: gate_proj up_proj).
    The experts of a mixture-of-experts base are named explicitly (experts.gate_up_proj,
    experts.down_proj; 'all' is the seven projections): their buffers are large."""
    wanted = {part for n in names for part in FUSED_MODULES.get(n, (n,))}
    experts = tuple(m for m in EXPERT_MODULES if m in wanted)
    if "all" in wanted:
        return ALL_MODULES + experts
    unknown = sorted(wanted - set(ALL_MODULES) - set(EXPERT_MODULES))
    if unknown:
        raise ValueError(
            f"--lora-target-modules: unknown {', '.join(unknown)}; use names from "
            f"{' '.join(ALL_MODULES + tuple(FUSED_MODULES) + EXPERT_MODULES)} or 'all'"
        )
    if not wanted:
        raise ValueError("--lora-target-modules needs at least one module name, or 'all'")
    return tuple(m for m in ALL_MODULES if m in wanted) + experts


def parse_lora_paths(items: Iterable[str], flag: str = "--lora-paths") -> dict[str, str]:
    """`--lora-paths NAME=SOURCE ...` (or `flag`'s) as {name: source}; each name one requests can use."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, source = item.partition("=")
        if not sep or not name or not source:
            raise ValueError(f"{flag} expects NAME=SOURCE, got {item!r}")
        if not is_adapter_name(name):
            raise ValueError(
                f"{flag} name {name!r} is invalid: {ADAPTER_NAME_RULE} (requests could not name it)"
            )
        if name in out:
            raise ValueError(f"{flag} names {name!r} twice ({out[name]!r} and {source!r})")
        out[name] = source
    return out


def check_backend_device(backend: str, device: torch.device) -> None:
    """The Triton kernels need CUDA, or Triton's interpreter on the CPU (TRITON_INTERPRET=1: tests)."""
    if backend == "triton" and device.type != "cuda" and not kernel_settings().triton_interpret:
        raise ValueError(
            "--lora-backend triton needs a CUDA device (or TRITON_INTERPRET=1); use torch on CPU"
        )


def _at_least_one(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1 (got {value})")


LORA_MEMORY = ("separate", "unified")


@dataclass(frozen=True)
class LoRAConfig:
    """The LoRA flags as given; None means "inferred or sized at start-up" (see lora/setup.py)."""

    lora_paths: tuple[str, ...] = ()  # NAME=SOURCE
    # At most this many distinct adapters compute in one step (the scheduler's turns,
    # engine/adapter_slices.py); never sizes the pool. None: every resident adapter may share a step.
    max_loras_per_batch: int | None = None
    # Bound on the pool's slots (sized from memory); None: DEFAULT_MAX_GPU_LORAS for the device.
    max_gpu_loras: int | None = None
    lora_backend: str | None = None  # triton | torch; None: triton on CUDA, torch on CPU
    disable_lora_side_stream: bool = False  # triton on CUDA: decode deltas beside the base matmul
    max_lora_rank: int | None = None  # None: the largest rank in lora_paths, else DEFAULT_MAX_LORA_RANK
    lora_target_modules: tuple[str, ...] | None = None  # None: the union of lora_paths' targets, else all
    max_loaded_loras: int | None = None  # host cache size; None = unbounded
    # Host tier in bytes (LRU beyond it); None: CPU_LORA_MEMORY_FRACTION of available host memory.
    max_cpu_lora_bytes: int | None = None
    # The slot queue's timings (lora/slot_rotation.py; None: its SLOT_WAIT_S and MIN_RESIDENT_S): how long a
    # waiting adapter waits before a busy slot is drained for it, and how long an upload keeps its slot.
    lora_slot_wait: float | None = None
    lora_rotation_quantum: float | None = None
    expert_lora_mode: str = "auto"  # one of EXPERT_LORA_MODES
    # Where the pool's rank pages live: "separate" (its own buffers, sized apart from the KV cache) or
    # "unified" (inside the KV cache's blocks, one free list: lora/unified.py, engine/unified_blocks.py).
    lora_memory: str = "separate"

    def __post_init__(self) -> None:
        _at_least_one("--max-loras-per-batch", self.max_loras_per_batch)
        _at_least_one("--max-gpu-loras", self.max_gpu_loras)
        _at_least_one("--max-lora-rank", self.max_lora_rank)
        _at_least_one("--max-loaded-loras", self.max_loaded_loras)
        _at_least_one("--max-cpu-lora-bytes", self.max_cpu_lora_bytes)
        for flag, seconds in (
            ("--lora-slot-wait", self.lora_slot_wait),
            ("--lora-rotation-quantum", self.lora_rotation_quantum),
        ):
            if seconds is not None and not 0 <= seconds < 3600:
                raise ValueError(f"{flag} must be in [0, 3600) seconds (got {seconds})")
        if self.lora_backend is not None and self.lora_backend not in LORA_BACKENDS:
            raise ValueError(
                f"--lora-backend must be one of {', '.join(LORA_BACKENDS)} (got {self.lora_backend!r})"
            )
        if self.lora_memory not in LORA_MEMORY:
            raise ValueError(
                f"--lora-memory must be one of {', '.join(LORA_MEMORY)} (got {self.lora_memory!r})"
            )
        if self.expert_lora_mode not in EXPERT_LORA_MODES:
            raise ValueError(
                f"--expert-lora-mode must be one of {', '.join(EXPERT_LORA_MODES)} "
                f"(got {self.expert_lora_mode!r})"
            )
        if self.lora_target_modules is not None:
            parse_target_modules(self.lora_target_modules)
        parse_lora_paths(self.lora_paths)

    @property
    def path_map(self) -> dict[str, str]:
        """`lora_paths` as {name: source}."""
        return parse_lora_paths(self.lora_paths)


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA flags resolved against the model and device: what every rank builds its pool from."""

    pool_slots: int  # adapters resident on the device at once (<= --max-gpu-loras; their pages: pool_pages)
    max_lora_rank: int
    target_modules: tuple[str, ...]
    max_loaded_loras: int | None
    backend: str  # "torch" | "triton"
    max_loras_per_batch: int | None = None  # distinct adapters per step; None: up to pool_slots
    max_cpu_lora_bytes: int | None = None  # the host tier's byte bound (None: unbounded)
    slot_timings: tuple[tuple[str, float], ...] = ()  # LoRAManager keyword arguments (slot_wait_s, ...)
    # The pool's pages of rank rows (lora/pool.py; sized from memory); None: every slot a max-rank adapter
    pool_pages: int | None = None

    @property
    def distinct_per_batch(self) -> int:
        """The most distinct adapters one step can hold (what GetModelInfo reports)."""
        cap = self.max_loras_per_batch
        return self.pool_slots if cap is None else min(cap, self.pool_slots)
