"""`build_tp_engine(config, lora)`: the engine for `--tp-size N > 1`.

Rank 0 is the server process: it loads its own shard, schedules, and before each forward
sends the step's chunks to ranks 1..N-1 (spawned workers, one per device); every rank then
runs the same `ModelRunner.forward` over its shard and the collectives inside the model
line the ranks up. Rank 0 samples from the gathered logits. CUDA graphs are off under TP
(capturing collectives is left to the multi-GPU work). LoRA follows `--lora-backend`:
the Triton kernels or the torch path, both with S-LoRA's sharding (`parallel/lora.py`).

Health: `TPAsyncEngine.healthy()` is False once any worker has died (the server should poll
it and report NOT_SERVING); from then on every request fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from loraplex.services.inference.engine.async_engine import AsyncEngine, default_model_info
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.kv_cache import plan_num_blocks
from loraplex.services.inference.engine.loading import LoadedModel
from loraplex.services.inference.engine.types import RequestOutput, SamplingParams
from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.settings import LoRAConfig, LoRASettings
from loraplex.services.inference.lora.setup import local_source, resolve_lora_settings
from loraplex.services.inference.lora.shapes import EXPERT_MODULES, ModelShapes, shapes_of_model
from loraplex.services.inference.models.config import ModelConfig, check_context_length, load_config
from loraplex.services.inference.models.loader import resolve_dtype, resolve_model_dir
from loraplex.services.inference.parallel.group import WorkerGroup
from loraplex.services.inference.parallel.lora import ShardedAdapterPool, make_tp_backend
from loraplex.services.inference.parallel.model import load_tp_model
from loraplex.services.inference.parallel.partition import ShardPlan, plan_shards
from loraplex.services.inference.parallel.worker import WorkerSpec, init_group

log = logging.getLogger(__name__)

TP_TIMEOUT_S = 300.0  # any one collective; a dead peer is noticed far sooner (process monitor)
LOAD_TIMEOUT_S = 3600.0  # a worker loading its shard of a large checkpoint


class _StepBroadcast:
    """Wraps rank 0's runner: every forward is first sent to the workers."""

    def __init__(self, runner, workers: WorkerGroup):
        self._runner, self._workers = runner, workers

    def forward(self, chunks):
        self._workers.broadcast(("step", chunks))
        try:
            return self._runner.forward(chunks)
        except Exception as exc:
            # The ranks may now wait in different collectives: no later step could line them up.
            self._workers.fail(f"rank 0's forward failed ({exc}); tensor-parallel ranks are out of step")
            raise BackendUnavailable(f"{self._workers.reason}; the server must be restarted") from exc

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


class TPEngine(LLMEngine):
    """LLMEngine on rank 0 of a tensor-parallel group."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, workers: WorkerGroup, **kwargs):
        super().__init__(loaded, config, **kwargs)
        self.workers = workers
        self.runner = _StepBroadcast(self.runner, workers)


class TPAsyncEngine(AsyncEngine):
    """`Engine` over a TPEngine: AsyncEngine plus the workers' health and their shutdown."""

    def __init__(self, engine: TPEngine, **kwargs):
        super().__init__(engine, **kwargs)
        self.workers = engine.workers
        self.workers.on_death = self._on_worker_death

    def healthy(self) -> bool:
        """False once a worker died or the engine shut down: report NOT_SERVING."""
        return self.workers.healthy and not self._stopped.is_set()

    def unhealthy_reason(self) -> str | None:
        return self.workers.reason

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        adapter: str | None,
        params: SamplingParams,
        draft_adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self.workers.healthy:
            raise BackendUnavailable(
                f"{self.workers.reason or 'the engine is shut down'}; the server must be restarted"
            )
        return super().generate(request_id, prompt, adapter, params, draft_adapter)

    def _on_worker_death(self, reason: str) -> None:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            # NCCL waits forever on a dead peer: abort the communicators so rank 0's pending
            # collective raises (gloo notices the closed socket by itself).
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - best effort; the health flag is already down
                log.exception("could not abort the NCCL process group")
        self._wake.set()  # the engine loop's next step fails the running requests with the reason

    async def shutdown(self, timeout: float = 10.0) -> None:
        await super().shutdown(timeout)
        await asyncio.to_thread(self._stop_workers)

    def _stop_workers(self) -> None:
        self.workers.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - an aborted (NCCL) group may refuse; the process moves on
                log.warning("could not destroy the tensor-parallel process group", exc_info=True)


class _Resolved(NamedTuple):
    """What every rank is built from, resolved once on rank 0 before any process starts."""

    model_dir: Path
    cfg: ModelConfig
    plans: list[ShardPlan]
    dtype: torch.dtype
    shapes: ModelShapes
    lora: LoRASettings
    context_length: int


def build_tp_engine(config: EngineConfig, lora_config: LoRAConfig) -> TPAsyncEngine:
    """Spawn the workers, load rank 0's shard, agree on the KV cache size, start the engine."""
    tp = config.tp_size
    config = dataclasses.replace(config, disable_cuda_graph=True, startup_warm_up=False)
    device = config.device
    if device.type == "cuda":
        if torch.cuda.device_count() < tp:
            raise ValueError(f"--tp-size {tp} needs {tp} GPUs; {torch.cuda.device_count()} are visible")
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        config = dataclasses.replace(config, device=device)
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process")
    model_dir = resolve_model_dir(config.model_path)
    cfg = load_config(model_dir)
    context_length = min(config.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    check_context_length(cfg, context_length)
    plans = plan_shards(cfg, tp)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, device)
    shapes = shapes_of_model(cfg)  # an MoE base's: LoRA on attention (and the experts, refused below)
    lora = resolve_lora_settings(lora_config, shapes, device, mem_fraction_static=config.mem_fraction_static)
    if lora_config.lora_memory != "separate":
        raise ValueError(
            f"--tp-size {tp}: --lora-memory unified is not sharded across ranks yet; use separate"
        )
    experts = [m for m in lora.target_modules if m in EXPERT_MODULES]
    if experts:
        raise ValueError(
            f"--tp-size {tp}: LoRA on the experts ({', '.join(experts)}) is not sharded across ranks yet; "
            "serve expert adapters with --tp-size 1, or attention adapters only under tensor parallelism"
        )
    setup = _Resolved(model_dir, cfg, plans, dtype, shapes, lora, context_length)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        tp,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TP_TIMEOUT_S),
    )
    specs = [
        WorkerSpec(
            rank=r,
            engine=config,
            model_dir=str(model_dir),
            dtype=dtype,
            context_length=context_length,
            lora=lora,
            store_port=store.port,
            timeout_s=TP_TIMEOUT_S,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        for r in range(1, tp)
    ]
    workers = WorkerGroup(specs)
    workers.start()
    try:
        return _build_rank0(lora_config, config, setup, store, workers)
    except BaseException:
        workers.stop(timeout_s=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def _build_rank0(
    lora_config: LoRAConfig, config: EngineConfig, setup: _Resolved, store: dist.Store, workers: WorkerGroup
) -> TPAsyncEngine:
    from transformers import AutoTokenizer

    model_dir, cfg, plans, dtype, shapes, lora, context_length = setup
    device, plan = config.device, plans[0]
    local_cfg = plan.local_config(cfg)
    model = load_tp_model(model_dir, plan, device, dtype, config.quantization)
    local_pool = AdapterPool(
        plan.local_shapes(shapes),
        slots=lora.pool_slots,
        max_rank=lora.max_lora_rank,
        target_modules=lora.target_modules,
        dtype=dtype,
        device=device,
        num_pages=lora.pool_pages,
    )
    own_blocks = plan_num_blocks(
        local_cfg,
        config.kv_dtype(dtype),
        device,
        page_size=config.page_size,
        context_length=context_length,
        max_running_requests=config.max_running_requests,
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=config.mem_fraction_static,
    )
    blocks = min([own_blocks, *workers.wait_loaded(LOAD_TIMEOUT_S)])
    init_group(0, plan.tp_size, store, device.type, TP_TIMEOUT_S)
    workers.broadcast(("start", blocks))
    workers.start_monitor()
    # Every rank's cache has the same block count, so rank 0's block tables are valid everywhere.
    config = dataclasses.replace(config, max_total_tokens=blocks * config.page_size)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded = LoadedModel(model, local_cfg, tokenizer, model_dir, device, dtype, context_length)
    pool = ShardedAdapterPool(shapes, plans, local_pool, workers.send_upload)
    manager = LoRAManager(
        pool,  # type: ignore[arg-type]
        max_loaded_loras=lora.max_loaded_loras,
        max_cpu_lora_bytes=lora.max_cpu_lora_bytes,
        max_loras_per_batch=lora.max_loras_per_batch,
        **dict(lora.slot_timings),
    )
    for name, source in lora_config.path_map.items():
        path = local_source(name, source)
        if path is not None:  # the server loads the others through the adapter store
            manager.load_adapter(name, path)
    backend = make_tp_backend(
        local_pool, lora.backend, config.max_num_batched_tokens, lora.max_loras_per_batch
    )
    engine = TPEngine(loaded, config, workers, adapter_slots=manager, lora_backend=backend)
    log.info(
        "tensor-parallel engine ready: %s over %d ranks (%s, %s), %d KV blocks per rank, LoRA pool %d bytes "
        "on rank 0",
        config.model_path,
        plan.tp_size,
        device.type,
        dtype,
        blocks,
        pool.nbytes,
    )
    info = dataclasses.replace(
        default_model_info(engine),
        max_loras_per_batch=lora.distinct_per_batch,
        max_lora_rank=lora.max_lora_rank,
        lora_target_modules=list(lora.target_modules),
        lora_backend=lora.backend,
        tp_size=plan.tp_size,
    )
    return TPAsyncEngine(engine, lora_manager=manager, model_info=info)
