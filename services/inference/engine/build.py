"""`build_engine(args)`: the one place the serving engine is put together."""

from __future__ import annotations

import logging

from services.inference.engine.async_engine import AsyncEngine
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import LLMEngine, load
from services.inference.server_args import ServerArgs

log = logging.getLogger(__name__)


def build_engine(args: ServerArgs) -> AsyncEngine:
    """Load the model, size and allocate the KV cache, start the engine thread.

    Order matters on GPU: weights, then the LoRA pool, then the KV cache, which takes what
    `--mem-fraction-static` leaves (or pass the pool's bytes as `kv_reserved_bytes` when it
    is allocated after the cache).
    """
    if args.tp_size != 1:
        raise ValueError(
            f"--tp-size {args.tp_size}: tensor parallelism is not implemented yet; use --tp-size 1"
        )
    config = EngineConfig.from_args(args)
    loaded = load(config)
    # LoRA hook: build the adapter pool, LoRABackend and manager (an AdapterSlots) here from
    # loaded.config / loaded.device / loaded.dtype, and pass them on below.
    engine = LLMEngine(loaded, config, adapter_slots=None, lora_backend=None, kv_reserved_bytes=0)
    log.info("engine ready: %s on %s (%s)", args.model_path, loaded.device, loaded.dtype)
    return AsyncEngine(engine, lora_manager=None)
