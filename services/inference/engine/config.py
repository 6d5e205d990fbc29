"""Engine configuration: what the scheduler, KV cache and runner need, resolved from ServerArgs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.inference.server_args import ServerArgs


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_num_batched_tokens: int  # all tokens of one step
    chunked_prefill_size: int  # prefill tokens of one step; <= 0 means no chunking
    max_running_requests: int
    context_length: int
    # Prefill tokens of a step while decodes are running (each chunk lengthens the step every
    # running decode waits for); <= 0: the same as `prefill_budget`.
    decode_prefill_budget: int = 0

    @property
    def prefill_budget(self) -> int:
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_num_batched_tokens

    def prefill_budget_for(self, decodes_running: bool) -> int:
        """Prefill tokens this step may take: `decode_prefill_budget` beside running decodes."""
        if decodes_running and self.decode_prefill_budget > 0:
            return min(self.decode_prefill_budget, self.prefill_budget)
        return self.prefill_budget


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: torch.device
    dtype_name: str  # as requested: auto | float32 | ...
    page_size: int = 16
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    context_length: int | None = None  # None = the model's max_position_embeddings
    max_total_tokens: int | None = None  # None = sized from memory
    mem_fraction_static: float = 0.88
    max_new_tokens_limit: int = 4096
    max_queued_requests: int = 4096
    seed: int = 0
    cuda_graph_max_bs: int = 256  # decode CUDA graphs up to this batch (CUDA only)
    disable_cuda_graph: bool = False
    # Steps with prefill chunks of up to this many tokens replay piecewise graphs (engine/mixed_graphs.py).
    mixed_cuda_graph_max_tokens: int = 2048
    # None: the piecewise path on CUDA (with graphs) when CUDA graphs are on, off elsewhere; True forces
    # it on (on the CPU its pieces then run eagerly over the same buffers: tests).
    mixed_graphs: bool | None = None
    decode_prefill_budget: int = 0  # see SchedulerConfig
    # Run every step shape class once at start-up so no Triton kernel compiles while serving
    # (engine/warmup.py; CUDA only). Off under tensor parallelism: a step there needs every rank.
    startup_warm_up: bool = True
    # Launch step N+1 before processing step N's outputs (engine.py). None = on for CUDA, off
    # elsewhere (on the CPU the forward is synchronous, so nothing overlaps); True forces it on (tests).
    overlap_schedule: bool | None = None
    disable_prefix_cache: bool = False  # reuse cached KV of shared prompt prefixes (engine/prefix_cache.py)

    @property
    def mixed_graphs_enabled(self) -> bool:
        if self.mixed_cuda_graph_max_tokens <= 0:
            return False
        if self.mixed_graphs is None:
            return self.device.type == "cuda" and not self.disable_cuda_graph
        return self.mixed_graphs

    @property
    def overlap_enabled(self) -> bool:
        return self.device.type == "cuda" if self.overlap_schedule is None else self.overlap_schedule

    @classmethod
    def from_args(cls, args: ServerArgs) -> EngineConfig:
        return cls(
            model_path=args.model_path,
            device=resolve_device(args.device),
            dtype_name=args.dtype,
            page_size=args.page_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            max_new_tokens_limit=args.max_new_tokens_limit,
            max_queued_requests=args.max_queued_requests,
            seed=args.seed,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            mixed_cuda_graph_max_tokens=args.mixed_cuda_graph_max_tokens,
            decode_prefill_budget=args.decode_prefill_budget,
            overlap_schedule=False if args.disable_overlap_schedule else None,
            disable_prefix_cache=args.disable_prefix_cache,
        )

    def scheduler_config(self, context_length: int) -> SchedulerConfig:
        return SchedulerConfig(
            page_size=self.page_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            context_length=context_length,
            decode_prefill_budget=self.decode_prefill_budget,
        )


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(requested)
