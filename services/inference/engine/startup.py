"""An LLMEngine's parts, built once before it serves: the paged KV cache sized from the memory
left and its block manager, the scheduler over them, and a model runner with its CUDA graphs
captured and its kernels compiled, so that no request pays for a capture or a compile
(kernels/compile_watch.py says why).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from loraplex.kernels.compile_watch import compile_counter
from loraplex.kernels.placement import triton_runs_on
from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token, plan_num_blocks
from loraplex.services.inference.engine.loading import LoadedModel
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.prefix_cache import base_model_digest
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.unified_blocks import unified_kv_cache
from loraplex.services.inference.engine.warmup import warm_up
from loraplex.services.inference.lora.adapter_slots import AdapterSlots
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.models.moe import graph_safe_max_tokens

log = logging.getLogger(__name__)


def build_kv_cache(
    loaded: LoadedModel,
    config: EngineConfig,
    reserved_bytes: int,
    draft_bytes_per_token: int = 0,
    lora_pool: AdapterPool | None = None,
) -> tuple[torch.Tensor, BlockManager]:
    """The KV cache, as large as `config` allows of the device memory left once `reserved_bytes`
    more are held back, and the block manager that hands out its blocks.

    `draft_bytes_per_token` (a draft model's KV, engine/draft_runner.py): the draft's cache gets as
    many tokens as this one, so the memory is shared between them in proportion to their bytes per
    token (with --max-total-tokens, the draft's share is held back as reserved bytes).

    `lora_pool` with `guaranteed_pages` set (--lora-memory unified): its pages live in the cache's
    blocks, one free list for both (engine/unified_blocks.py)."""
    if lora_pool is not None and lora_pool.guaranteed_pages is not None:
        if draft_bytes_per_token:
            raise ValueError("--lora-memory unified with a draft model is not supported yet; use separate")
        return unified_kv_cache(
            loaded, config, lora_pool, lambda extra: _plan(loaded, config, reserved_bytes + extra)
        )
    kv_dtype = config.kv_dtype(loaded.dtype)
    if draft_bytes_per_token and config.max_total_tokens is not None:
        reserved_bytes += config.max_total_tokens * draft_bytes_per_token
    num_blocks = _plan(loaded, config, reserved_bytes)
    if draft_bytes_per_token and config.max_total_tokens is None:
        own = kv_bytes_per_token(loaded.config, kv_dtype)
        num_blocks = max(1, num_blocks * own // (own + draft_bytes_per_token))
    kv_cache = allocate_kv_cache(loaded.config, num_blocks, config.page_size, kv_dtype, loaded.device)
    return kv_cache, BlockManager(num_blocks, config.page_size, prefix_cache=not config.disable_prefix_cache)


def _plan(loaded: LoadedModel, config: EngineConfig, reserved_bytes: int) -> int:
    return plan_num_blocks(
        loaded.config,
        config.kv_dtype(loaded.dtype),
        loaded.device,
        page_size=config.page_size,
        context_length=loaded.context_length,
        max_running_requests=config.max_running_requests,
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=config.mem_fraction_static,
        reserved_bytes=reserved_bytes,
        activation_dtype=loaded.dtype,  # an FP8 cache logs its gain in blocks
    )


def build_scheduler(
    loaded: LoadedModel, config: EngineConfig, blocks: BlockManager, adapter_slots: AdapterSlots
) -> Scheduler:
    """The scheduler over `blocks` and `adapter_slots`; its prefix cache (unless disabled) is keyed
    by this base model's digest."""
    caching = not config.disable_prefix_cache
    base_digest = base_model_digest(loaded.model_dir, str(loaded.dtype)) if caching else "base:uncached"
    scheduler = Scheduler(
        config.scheduler_config(loaded.context_length), blocks, adapter_slots, base_digest=base_digest
    )
    log.info(
        "prefix cache: %s",
        f"on (base model {base_digest[:21]})" if caching else "off (--disable-prefix-cache)",
    )
    return scheduler


def build_runner(
    loaded: LoadedModel, config: EngineConfig, kv_cache: torch.Tensor, lora_backend: LoRABackend | None
) -> tuple[ModelRunner, EngineConfig]:
    """A runner over `kv_cache`, ready to serve, and the config it serves with: `config` less the
    CUDA graphs this model and LoRA backend cannot capture (LLMEngine.config is that one)."""
    runner = ModelRunner(
        loaded.model,
        loaded.config,
        kv_cache,
        max_num_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_running_requests,
        context_length=loaded.context_length,
        lora_backend=lora_backend,
        max_decode_rows=decode_rows(config),
    )
    config = _capturable(config, loaded, lora_backend)
    if loaded.device.type == "cuda" and not config.disable_cuda_graph and config.cuda_graph_max_bs > 0:
        runner.capture_cuda_graphs(decode_graph_max_bs(config))
    if config.mixed_graphs_enabled:
        # On CUDA with captured graphs; elsewhere the same pieces run eagerly (tests).
        try:
            runner.capture_mixed_graphs(
                min(config.mixed_cuda_graph_max_tokens, config.max_num_batched_tokens),
                use_graphs=loaded.device.type == "cuda" and not config.disable_cuda_graph,
            )
        except (RuntimeError, torch.OutOfMemoryError):
            # Serving without them is slower, not wrong: say so loudly and go on eagerly.
            log.exception(
                "could not capture the mixed-step CUDA graphs; steps with prefill chunks run "
                "eagerly (set --mixed-cuda-graph-max-tokens lower, or 0)"
            )
            runner.mixed_graphs = None
    if triton_runs_on(loaded.device) and config.startup_warm_up:
        # Compile every kernel variant a step can need now, not on the engine thread while serving.
        warm_up(
            runner,
            max_num_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_running_requests,
            context_length=loaded.context_length,
        )
        compile_counter.mark_serving()
    return runner, config


def decode_rows(config: EngineConfig) -> int:
    """The most decode rows a step can hold: a row per running sequence, or, in a speculating step
    (at most --speculative-disable-batch-size sequences), K + 1 rows per verifying sequence
    (ModelRunner._verify_as_decode_rows); never past --max-num-batched-tokens."""
    rows = config.max_running_requests
    if config.speculative_algorithm is not None:
        speculating = min(config.speculative_disable_batch_size, config.max_running_requests)
        rows = max(rows, speculating * (config.speculative_num_draft_tokens + 1))
    return min(rows, config.max_num_batched_tokens)


def decode_graph_max_bs(config: EngineConfig) -> int:
    """The largest decode batch worth a CUDA graph: a step holds at most `decode_rows` rows (the
    runner's buffers are sized by it)."""
    return min(config.cuda_graph_max_bs, decode_rows(config))


def _capturable(config: EngineConfig, loaded: LoadedModel, lora_backend: LoRABackend | None) -> EngineConfig:
    """`config` with the CUDA graphs turned off (and logged) that would read the step on the host."""
    experts = getattr(lora_backend, "experts", None)
    if (
        experts is not None
        and not experts.graph_safe
        and loaded.device.type == "cuda"
        and not config.disable_cuda_graph
    ):
        # lora/expert_lora.py reads the step's adapter slots on the host: not capturable
        # (lora/expert_lora_graph.py reads none: its steps capture as the base experts' path allows).
        log.warning(
            "LoRA on the experts is enabled (--lora-target-modules experts.*): CUDA graphs are off "
            "(--expert-lora-mode graphs keeps them)"
        )
        config = dataclasses.replace(config, disable_cuda_graph=True)
    moe_graph_tokens = graph_safe_max_tokens(loaded.device) if loaded.config.is_moe else None
    if moe_graph_tokens is not None and loaded.device.type == "cuda" and not config.disable_cuda_graph:
        # The torch experts (bench/moe.py's control row) read per-expert token counts on the host
        # above models/moe.py's DENSE_MAX_TOKENS: only decode batches up to it capture.
        log.warning(
            "%s with the torch experts: decode CUDA graphs up to batch %d, mixed-step graphs off",
            loaded.config.architecture,
            moe_graph_tokens,
        )
        config = dataclasses.replace(
            config,
            cuda_graph_max_bs=min(config.cuda_graph_max_bs, moe_graph_tokens),
            mixed_cuda_graph_max_tokens=0,
        )
    return config
