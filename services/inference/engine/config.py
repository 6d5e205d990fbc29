"""Engine configuration: what the scheduler, KV cache and runner need, and the engine flags' defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.services.inference.lora.settings import parse_lora_paths


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


DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the activation dtype; fp8: E4M3, per-layer scales (kv_cache.py)
QUANTIZATIONS = ("fp8",)  # models/quantization/scheme.py; a checkpoint's own quantization_config needs none
DEVICES = ("auto", "cuda", "cpu")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")  # engine/speculative.py, engine/draft_runner.py


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built from, with the default of every engine flag (the CLI parser takes
    its defaults from here). `device` may be given as "auto" | "cuda" | "cpu" and is a
    torch.device once constructed."""

    model_path: str = ""
    device: torch.device = "auto"  # type: ignore[assignment] - resolved in __post_init__
    dtype: str = "auto"  # as requested: auto | bfloat16 | float16 | float32
    # "fp8": quantize the base linears to E4M3 at load (a pre-quantized FP8 checkpoint needs no flag)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tp_size: int = 1  # > 1: one worker process per device (services/inference/parallel/)
    seed: int = 0
    page_size: int = 16
    max_num_batched_tokens: int = 8192
    chunked_prefill_size: int = 2048  # <= 0: no chunking (the step budget bounds a prefill)
    max_running_requests: int = 256
    context_length: int | None = None  # None = the model's max_position_embeddings
    max_total_tokens: int | None = None  # None = sized from memory
    mem_fraction_static: float = 0.88
    max_new_tokens_limit: int = 4096
    max_queued_requests: int = 4096
    cuda_graph_max_bs: int = 256  # decode CUDA graphs up to this batch (CUDA only); 0 = none
    disable_cuda_graph: bool = False
    # Steps with prefill chunks of up to this many tokens replay piecewise graphs
    # (engine/mixed_graphs.py); 0 = such steps run eagerly.
    mixed_cuda_graph_max_tokens: int = 2048
    # None: the piecewise path on CUDA (with graphs) when CUDA graphs are on, off elsewhere; True
    # forces it on (on the CPU its pieces then run eagerly over the same buffers: tests).
    mixed_graphs: bool | None = None
    decode_prefill_budget: int = 0  # see SchedulerConfig
    # Run every step shape class once at start-up so no Triton kernel compiles while serving
    # (engine/warmup.py; CUDA only). Off under tensor parallelism: a step there needs every rank.
    startup_warm_up: bool = True
    # Launch step N+1 before processing step N's outputs (engine/step_loop.py). None = on for CUDA, off
    # elsewhere (on the CPU the forward is synchronous, so nothing overlaps); False is
    # --disable-overlap-schedule; True forces it on (tests).
    overlap_schedule: bool | None = None
    disable_prefix_cache: bool = False  # reuse cached KV of shared prompt prefixes (engine/prefix_cache.py)
    # Compiled grammars kept for reuse, all together and one alone (engine/grammar_cache.py).
    grammar_cache_max_bytes: int = 512 * 2**20
    grammar_max_bytes: int = 64 * 2**20
    # Speculative decoding (engine/speculative.py): None = off; "ngram" drafts by prompt lookup,
    # "draft" with the model at speculative_draft_model_path (same tokenizer). A step that speculates
    # runs without overlap (a draft needs the previous step's tokens on the host); the others keep it.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    # NAME=DIR LoRA adapters of the draft model, loaded at start; a request names one as its
    # `draft_adapter` (engine/draft_runner.py).
    speculative_draft_lora_paths: tuple[str, ...] = ()
    speculative_num_draft_tokens: int = 4
    # No speculation in a step with more running requests than this (verification would cost more
    # than it saves).
    speculative_disable_batch_size: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", resolve_device(self.device))
        _check(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.kv_cache_dtype!r})",
        )
        _check(
            self.quantization in (None, *QUANTIZATIONS),
            f"--quantization must be one of {', '.join(QUANTIZATIONS)} (got {self.quantization!r})",
        )
        for flag, value, low in (
            ("--tp-size", self.tp_size, 1),
            ("--seed", self.seed, 0),
            ("--page-size", self.page_size, 1),
            ("--max-num-batched-tokens", self.max_num_batched_tokens, 1),
            ("--max-running-requests", self.max_running_requests, 1),
            ("--context-length", self.context_length, 1),
            ("--max-total-tokens", self.max_total_tokens, 1),
            ("--max-new-tokens-limit", self.max_new_tokens_limit, 1),
            ("--max-queued-requests", self.max_queued_requests, 1),
            ("--cuda-graph-max-bs", self.cuda_graph_max_bs, 0),
            ("--mixed-cuda-graph-max-tokens", self.mixed_cuda_graph_max_tokens, 0),
            ("--decode-prefill-budget", self.decode_prefill_budget, 0),
            ("--grammar-cache-max-bytes", self.grammar_cache_max_bytes, 1),
            ("--grammar-max-bytes", self.grammar_max_bytes, 1),
            ("--speculative-num-draft-tokens", self.speculative_num_draft_tokens, 1),
            ("--speculative-disable-batch-size", self.speculative_disable_batch_size, 1),
        ):
            _check(value is None or value >= low, f"{flag} must be >= {low} (got {value})")
        _check(
            self.speculative_algorithm in (None, *SPECULATIVE_ALGORITHMS),
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} "
            f"(got {self.speculative_algorithm!r})",
        )
        _check(
            (self.speculative_algorithm == "draft") == bool(self.speculative_draft_model_path),
            "--speculative-draft-model-path is needed by --speculative-algorithm draft and by nothing "
            f"else (got algorithm {self.speculative_algorithm!r}, "
            f"path {self.speculative_draft_model_path!r})",
        )
        _check(
            not self.speculative_draft_lora_paths or self.speculative_algorithm == "draft",
            "--speculative-draft-lora-paths needs --speculative-algorithm draft",
        )
        parse_lora_paths(self.speculative_draft_lora_paths, flag="--speculative-draft-lora-paths")
        _check(
            self.speculative_algorithm != "draft" or self.tp_size == 1,
            "--speculative-algorithm draft runs on one device: it is not built for --tp-size > 1",
        )
        _check(
            0.0 < self.mem_fraction_static <= 1.0,
            f"--mem-fraction-static must be in (0, 1] (got {self.mem_fraction_static})",
        )

    def kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for activations in `dtype`."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else dtype

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

    def scheduler_config(self, context_length: int) -> SchedulerConfig:
        return SchedulerConfig(
            page_size=self.page_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill_size=self.chunked_prefill_size,
            max_running_requests=self.max_running_requests,
            context_length=context_length,
            decode_prefill_budget=self.decode_prefill_budget,
        )


def resolve_device(requested: str | torch.device) -> torch.device:
    if isinstance(requested, torch.device):
        return requested
    if requested not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)} (got {requested!r})")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(requested)
