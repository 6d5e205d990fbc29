"""A tensor-parallel worker (rank >= 1): loads its shard, then mirrors rank 0 step by step.

Control messages come from rank 0 over a pipe, pickled (ordered, so an adapter upload always
lands before the step that uses it); tensors move only through torch.distributed collectives
inside the forward. Protocol:
- worker -> rank 0: `("loaded", num_blocks)` once its shard is in memory, or `("error", text)`.
- rank 0 -> worker: `("start", num_blocks)`, then any of `("step", chunks)`,
  `("lora", slot, shard)`, `("stop",)`.
A closed pipe (rank 0 gone) or a failed collective ends the worker; rank 0 watches for that.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.lora.settings import LoRASettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker is started with: the engine's config and the LoRA settings as rank 0
    resolved them (so every rank builds the same pool and KV cache plan), plus its place."""

    rank: int
    engine: EngineConfig  # tp_size, page_size, token and request budgets, memory share
    model_dir: str  # resolved on rank 0
    dtype: torch.dtype  # resolved on rank 0
    context_length: int  # resolved on rank 0
    lora: LoRASettings | None
    store_port: int
    timeout_s: float
    log_level: int = logging.INFO

    @property
    def tp_size(self) -> int:
        return self.engine.tp_size

    @property
    def device_type(self) -> str:
        """The device type, cpu or cuda (rank r uses cuda:r)."""
        return self.engine.device.type


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())  # noqa: S301 - our own child/parent pipe


def init_group(rank: int, tp_size: int, store: dist.Store, device_type: str, timeout_s: float) -> None:
    """The default process group: NCCL on CUDA, gloo on CPU; nothing else differs."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=tp_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    # A terminal's Ctrl-C reaches the whole process group; rank 0 decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format=f"%(asctime)s tp{spec.rank} %(levelname)s %(name)s: %(message)s"
    )
    try:
        _serve(spec, conn)
    except EOFError:
        log.error("TP worker rank %d: rank 0 closed the pipe; exiting", spec.rank)
        raise SystemExit(3) from None
    except Exception as exc:
        log.exception("TP worker rank %d failed", spec.rank)
        try:
            send(conn, ("error", f"rank {spec.rank}: {exc}\n{traceback.format_exc(limit=4)}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    from loraplex.services.inference.engine.kv_cache import allocate_kv_cache, plan_num_blocks
    from loraplex.services.inference.engine.model_runner import ModelRunner
    from loraplex.services.inference.engine.startup import decode_rows
    from loraplex.services.inference.lora.pool import AdapterPool
    from loraplex.services.inference.lora.shapes import ModelShapes
    from loraplex.services.inference.models.config import load_config
    from loraplex.services.inference.parallel.lora import make_tp_backend
    from loraplex.services.inference.parallel.model import load_tp_model
    from loraplex.services.inference.parallel.partition import plan_shards

    config = spec.engine
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.rank)
        device = torch.device("cuda", spec.rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.tp_size))  # the ranks share the cores
    model_dir = Path(spec.model_dir)
    cfg = load_config(model_dir)
    plan = plan_shards(cfg, spec.tp_size)[spec.rank]
    local_cfg = plan.local_config(cfg)
    model = load_tp_model(model_dir, plan, device, spec.dtype, config.quantization)
    pool = backend = None
    if spec.lora is not None:
        s = spec.lora
        shapes = plan.local_shapes(
            ModelShapes(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)
        )
        pool = AdapterPool(
            shapes,
            slots=s.pool_slots,
            max_rank=s.max_lora_rank,
            target_modules=s.target_modules,
            dtype=spec.dtype,
            device=device,
            num_pages=s.pool_pages,
        )
        backend = make_tp_backend(pool, s.backend, config.max_num_batched_tokens, s.max_loras_per_batch)
    blocks = plan_num_blocks(
        local_cfg,
        config.kv_dtype(spec.dtype),
        device,
        page_size=config.page_size,
        context_length=spec.context_length,
        max_running_requests=config.max_running_requests,
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=config.mem_fraction_static,
    )
    store = dist.TCPStore(
        "127.0.0.1",
        spec.store_port,
        spec.tp_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )
    send(conn, ("loaded", blocks))
    init_group(spec.rank, spec.tp_size, store, spec.device_type, spec.timeout_s)
    kind, num_blocks = recv(conn)
    assert kind == "start", kind
    kv_cache = allocate_kv_cache(local_cfg, num_blocks, config.page_size, config.kv_dtype(spec.dtype), device)
    runner = ModelRunner(
        model,
        local_cfg,
        kv_cache,
        max_num_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_running_requests,
        context_length=spec.context_length,
        lora_backend=backend,
        max_decode_rows=decode_rows(config),  # the same layout as rank 0's runner
    )
    log.info("TP worker rank %d ready (%d KV blocks)", spec.rank, num_blocks)
    while True:
        message = recv(conn)
        kind = message[0]
        if kind == "step":
            runner.forward(message[1])  # the logits are rank 0's to sample
        elif kind == "lora":
            _, slot, shard = message
            if shard is None:  # the slot's adapter left the pool: its pages go back
                pool.release(slot)
                continue
            pool.upload(slot, shard)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the next step must see the whole upload
        elif kind == "stop":
            log.info("TP worker rank %d stopping", spec.rank)
            return
        else:
            raise ValueError(f"unknown message {kind!r}")
