"""`build_engine(config, lora)`: the one place the serving engine is put together."""

from __future__ import annotations

import dataclasses
import logging

from loraplex.services.inference.engine.async_engine import AsyncEngine, default_model_info
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.loading import LoadedModel, load
from loraplex.services.inference.lora.settings import LoRAConfig
from loraplex.services.inference.lora.setup import LoRAStack, build_lora
from loraplex.services.inference.lora.shapes import shapes_of_model

log = logging.getLogger(__name__)


def build_llm_engine(
    config: EngineConfig, lora_config: LoRAConfig, loaded: LoadedModel | None = None
) -> tuple[LLMEngine, LoRAStack]:
    """The single-device engine and its LoRA parts, not yet running (`build_engine` starts it;
    tests drive it synchronously).

    Order matters on GPU: weights, then the LoRA pool, then the KV cache, which takes what
    `--mem-fraction-static` leaves (or pass the pool's bytes as `kv_reserved_bytes` when it
    is allocated after the cache). `loaded`: weights already loaded for `config` (benchmarks that
    rebuild the engine per scenario load them once).
    """
    loaded = loaded or load(config)
    c = loaded.config
    shapes = shapes_of_model(c)
    # The pool is allocated before the KV cache is sized, so the KV cache gets what is left.
    lora = build_lora(
        lora_config,
        shapes,
        dtype=loaded.dtype,
        device=loaded.device,
        max_tokens=config.max_num_batched_tokens,
        mem_fraction_static=config.mem_fraction_static,
        base_weight=loaded.model.lora_base_weight,
    )
    engine = LLMEngine(
        loaded, config, adapter_slots=lora.manager, lora_backend=lora.backend, kv_reserved_bytes=0
    )
    log.info("engine ready: %s on %s (%s)", config.model_path, loaded.device, loaded.dtype)
    return engine, lora


def build_engine(config: EngineConfig, lora_config: LoRAConfig) -> AsyncEngine:
    """Load the model, size and allocate the KV cache, start the engine thread."""
    if config.tp_size != 1:  # one worker process per device (services/inference/parallel/)
        from loraplex.services.inference.parallel.tp_engine import build_tp_engine

        return build_tp_engine(config, lora_config)
    engine, lora = build_llm_engine(config, lora_config)
    s = lora.settings
    info = dataclasses.replace(
        default_model_info(engine),
        max_loras_per_batch=s.distinct_per_batch,
        max_lora_rank=s.max_lora_rank,
        lora_target_modules=list(s.target_modules),
        lora_backend=s.backend,
    )
    return AsyncEngine(engine, lora_manager=lora.manager, model_info=info)
