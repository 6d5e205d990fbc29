"""What bench/workload.py sends requests to: the engine in-process (GPU or CPU) or a gRPC server.

A factory is opened once per run (it writes or finds the random model and adapters, and loads
the model weights once); `factory.scenario(n, k)` yields a Target serving n adapters under
`--max-loras-per-batch k` (None: default flags), rebuilt per scenario so no state carries over.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
)
ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
DISTINCT_WEIGHTS = 64  # adapters with weights of their own; the rest link to these


class Target(Protocol):
    adapter_names: list[str]

    def stream(
        self, rid: str, prompt_ids: list[int], adapter: str | None, max_new_tokens: int
    ) -> AsyncIterator[int]:
        """Yields (tokens in each streamed increment, the request's queue time in seconds or None)."""

    def queue_sizes(self) -> tuple[int, int] | None: ...  # (running, waiting) now, when known

    def counters(self) -> dict[str, int | None]: ...  # cumulative uploads / evictions, when known

    def describe(self) -> dict: ...


def _workdir(opts) -> Path:
    if opts.workdir is not None:
        return opts.workdir
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "loraplex" / f"workload-{opts.mode}{'-tiny' if getattr(opts, 'tiny', False) else ''}"


def _ensure_files(root: Path, shape: dict, count: int, rank: int, device: str) -> tuple[Path, list[Path]]:
    """The random model and `count` random adapters under `root`, written once and reused. Past
    DISTINCT_WEIGHTS, adapter i's weights file is a hard link to adapter i % DISTINCT_WEIGHTS's (1,024
    adapters of an 8B shape would be 27 GB to write), with its own config (another lora_alpha), so
    each is still another adapter to the server: its own digest, slot, uploads and prefix cache."""
    from loraplex.bench.serving_setup import write_adapters, write_model_dir

    model = root / "model"
    if not (model / "model.safetensors.index.json").exists():
        log.warning("writing a random %s model to %s", shape, model)
        write_model_dir(model, shape, device=device)
    adapters = root / f"adapters-r{rank}"
    have = sorted(p.parent for p in adapters.glob("adapter*/adapter_config.json"))
    distinct = min(count, DISTINCT_WEIGHTS)
    if len(have) < distinct:
        log.warning("writing %d random rank-%d adapters to %s", distinct, rank, adapters)
        have = write_adapters(
            adapters, model, distinct, shape=shape, rank=rank, device=device, modules=ADAPTER_MODULES
        )
    for i in range(len(have), count):
        src, dst = adapters / f"adapter{i % DISTINCT_WEIGHTS:02d}", adapters / f"adapter{i:02d}"
        dst.mkdir(exist_ok=True)
        if not (dst / "adapter_model.safetensors").exists():
            os.link(src / "adapter_model.safetensors", dst / "adapter_model.safetensors")
        config = json.loads((src / "adapter_config.json").read_text())
        config["lora_alpha"] += i // DISTINCT_WEIGHTS
        (dst / "adapter_config.json").write_text(json.dumps(config, indent=1))
        have.append(dst)
    return model, sorted(have)[:count]


# Fields whose default is None but whose values are ints.
INT_OR_NONE = (
    "max_total_tokens",
    "context_length",
    "max_gpu_loras",
    "max_loras_per_batch",
    "max_lora_rank",
    "max_loaded_loras",
)


def _server_overrides(pairs: list[str]) -> dict:
    from loraplex.services.inference.server_args import flat_defaults

    defaults = flat_defaults()
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if key not in defaults:
            raise SystemExit(f"--server-arg {pair!r}: no ServerArgs field {key!r}")
        default = defaults[key]
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, int) or key in INT_OR_NONE:
            out[key] = int(value)
        elif isinstance(default, float):
            out[key] = float(value)
        else:
            out[key] = value
    return out


class EngineTarget:
    def __init__(self, engine, lora, names: list[str], max_gpu_loras: int | None = None):
        self.engine, self.lora, self.adapter_names = engine, lora, names
        self.max_gpu_loras = max_gpu_loras

    async def stream(self, rid, prompt_ids, adapter, max_new_tokens):
        from loraplex.services.inference.engine.types import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        async for out in self.engine.generate(rid, prompt_ids, adapter, params):
            yield len(out.new_token_ids), out.queue_time if out.new_token_ids else None

    def queue_sizes(self):
        s = self.engine.stats()
        return s.running, s.waiting

    def counters(self):
        m = self.lora.manager
        return {
            "uploads": getattr(m, "num_uploads", None),
            "evictions": sum(i.evictions for i in m.list_adapters()),
        }

    def describe(self):
        llm = self.engine.engine
        s = self.lora.settings
        return dict(
            pool_slots=self.lora.pool.slots,
            max_gpu_loras=self.max_gpu_loras,
            max_loras_per_batch=getattr(s, "max_loras_per_batch", None),
            max_lora_rank=s.max_lora_rank,
            target_modules=list(s.target_modules),
            backend=s.backend,
            block_manager=type(llm.block_manager).__name__,  # UnifiedBlocks under --lora-memory unified
            kv_tokens=llm.block_manager.capacity_tokens,
            pool_mib=round(self.lora.pool.nbytes / 2**20, 1),
        )


class EngineFactory:
    """Loads the model once; builds the LoRA stack, KV cache and engine per scenario."""

    def __init__(self, opts, *, cpu: bool):
        import torch

        from loraplex.bench.serving_setup import LLAMA_8B
        from loraplex.services.inference.engine.loading import load

        if not cpu and not torch.cuda.is_available():
            raise SystemExit("--mode engine needs a CUDA device (use --mode cpu on the CPU)")
        self.cpu = cpu
        self.shape = TINY if cpu or getattr(opts, "tiny", False) else LLAMA_8B
        self.device = "cpu" if cpu else "cuda"
        self.root = _workdir(opts)
        self.rank = opts.adapter_rank
        self.vocab_range = (1, self.shape["vocab_size"] - 2)
        self.num_adapters = 0
        self.model, _ = _ensure_files(self.root, self.shape, 0, self.rank, self.device)
        base = dict(model_path=str(self.model), device=self.device, dtype="float32" if cpu else "bfloat16")
        if self.shape is TINY:  # a KV cache sized from GPU memory would hold millions of tiny pages
            base.update(context_length=1024, max_total_tokens=65536)
        base.update(_server_overrides(opts.server_arg))
        self.base_args = base
        from loraplex.services.inference.server_args import ServerArgs

        self.loaded = load(ServerArgs.from_fields(**base).engine)

    def prepare(self, max_adapters: int) -> None:
        """Write every adapter the run needs at once (not the first N again for each larger N)."""
        _ensure_files(self.root, self.shape, max_adapters, self.rank, self.device)

    @asynccontextmanager
    async def scenario(self, n: int, max_loras_per_batch: int | None, max_gpu_loras: int | None = None):
        from loraplex.services.inference.engine.async_engine import AsyncEngine
        from loraplex.services.inference.engine.build import build_llm_engine
        from loraplex.services.inference.server_args import ServerArgs

        _, paths = _ensure_files(self.root, self.shape, n, self.rank, self.device)
        names = [f"a{i:03d}" for i in range(n)]
        kw = dict(self.base_args, lora_paths=tuple(f"{a}={p}" for a, p in zip(names, paths, strict=True)))
        if max_loras_per_batch is not None:
            kw["max_loras_per_batch"] = max_loras_per_batch
        if max_gpu_loras is not None:
            kw["max_gpu_loras"] = max_gpu_loras
        args = ServerArgs.from_fields(**kw)
        llm, lora = build_llm_engine(args.engine, args.lora, loaded=self.loaded)
        engine = AsyncEngine(llm, lora_manager=lora.manager)
        target = EngineTarget(engine, lora, names, kw.get("max_gpu_loras"))
        try:
            yield target
        finally:
            await engine.shutdown()
            # The caller may still hold `target`: drop its engine so the KV cache, pool and graphs
            # are freed before the next scenario sizes its own from free memory.
            target.engine = target.lora = None
            del engine, llm, lora
            gc.collect()
            if not self.cpu:
                import torch

                torch.cuda.empty_cache()


class GrpcTarget:
    def __init__(self, client, names: list[str]):
        self.client, self.adapter_names = client, names

    async def stream(self, rid, prompt_ids, adapter, max_new_tokens):
        # Words `t<id>` are single tokens for bench/serving_setup's tokenizer (approximate elsewhere).
        text = " ".join(f"t{i}" for i in prompt_ids)
        async for msg in self.client.generate_stream(
            text, adapter, max_new_tokens=max_new_tokens, ignore_eos=True, timeout=600
        ):
            yield len(msg.token_ids), None

    def queue_sizes(self):
        return None

    def counters(self):
        return {"uploads": None, "evictions": None}

    def describe(self):
        return {"target": self.client_target}


class GrpcFactory:
    def __init__(self, client, target: str, names: list[str]):
        self.client, self.target, self.names = client, target, names
        self.num_adapters = len(names)
        self.vocab_range = (1, 32000)

    def prepare(self, max_adapters: int) -> None:
        if max_adapters > len(self.names):
            raise SystemExit(f"the server has {len(self.names)} adapters; a scenario wants {max_adapters}")

    @asynccontextmanager
    async def scenario(self, n: int, max_loras_per_batch: int | None, max_gpu_loras: int | None = None):
        if max_loras_per_batch is not None or max_gpu_loras is not None:
            raise SystemExit(
                "grpc mode cannot change --max-loras-per-batch or --max-gpu-loras: start the server "
                "with them and name the scenario zipf:N"
            )
        t = GrpcTarget(self.client, self.names[:n])
        t.client_target = self.target
        yield t


@asynccontextmanager
async def open_target(opts):
    if opts.mode == "grpc":
        if not opts.target:
            raise SystemExit("--mode grpc needs --target HOST:PORT")
        from loraplex.clients.aio import AsyncClient

        async with AsyncClient(opts.target, token=opts.token) as client:
            names = sorted(a.name for a in await client.list_adapters())
            yield GrpcFactory(client, opts.target, names)
        return
    yield EngineFactory(opts, cpu=opts.mode == "cpu")
