"""Command-line flags of `python -m loraplex.services.inference`, as frozen dataclasses.

`ServerArgs` holds the server's own flags and composes the two configs that own the rest of the
defaults: `EngineConfig` (engine/config.py) and `LoRAConfig` (lora/settings.py). The parser
takes every default from those dataclasses, and `parse_args` checks every flag (ranges, choices
and combinations) so a bad command line fails before the model loads. Flag names and defaults
follow SGLang's where SGLang has one (design brief §5).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from loraplex.services.inference.engine.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    EngineConfig,
)
from loraplex.services.inference.lora.names import is_served_model_name
from loraplex.services.inference.lora.settings import (
    CPU_LORA_MEMORY_FRACTION,
    DEFAULT_MAX_GPU_LORAS,
    DEFAULT_MAX_LORA_RANK,
    EXPERT_LORA_MODES,
    LORA_BACKENDS,
    LORA_MEMORY,
    LoRAConfig,
    check_backend_device,
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# gRPC caps a message at 2 GiB - 1; the server's own limit sits 1 MiB above --max-message-bytes.
MAX_MESSAGE_BYTES = (1 << 31) - 1 - (1 << 20)


@dataclass(frozen=True)
class ServerArgs:
    """Every flag: the engine's in `engine`, the LoRA ones in `lora`, the server's own here.
    Construction checks the server's flags and the combinations across the three."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Adapter store
    adapter_store: str = "none"  # HOST:PORT | none
    adapter_cache_dir: str | None = None  # adapters pulled from the store; None = ~/.cache/loraplex/inference
    adapter_store_tls_ca: str | None = None  # PEM: talk TLS to the store, verified with it
    # bytes the adapter cache may hold; None = half the free space of its disk at start
    adapter_cache_max_bytes: int | None = None
    # Request limits
    default_max_new_tokens: int = 128
    max_inputs_per_request: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    # Server
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    metrics_max_adapters: int = 256  # adapters with series of their own; the rest count as _other
    grace_period: float = 30.0
    listen_when_ready: bool = False
    replica_id: str = ""  # sent as trailing metadata x-loraplex-replica; "" = the hostname
    admin_token: str | None = field(default=None, repr=False)
    api_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    allowed_local_dirs: tuple[str, ...] = ()
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_server_args(self)

    @classmethod
    def from_fields(cls, **values: Any) -> ServerArgs:
        """Build from flat field names (one per flag, as `parse_args` and tests use them): each goes
        to the object that owns it. Raises ValueError naming an unknown field."""
        parts: dict[type, dict[str, Any]] = {EngineConfig: {}, LoRAConfig: {}, cls: {}}
        owner = flat_field_owners()
        for key, value in values.items():
            if key not in owner:
                raise ValueError(f"no server flag field {key!r}")
            parts[owner[key]][key] = value
        return cls(
            engine=EngineConfig(**parts[EngineConfig]), lora=LoRAConfig(**parts[LoRAConfig]), **parts[cls]
        )


def flat_field_owners() -> dict[str, type]:
    """Every flat field name -> the dataclass that owns it (and its default)."""
    own = {f.name: ServerArgs for f in dataclasses.fields(ServerArgs) if f.name not in ("engine", "lora")}
    return {
        **{f.name: EngineConfig for f in dataclasses.fields(EngineConfig)},
        **{f.name: LoRAConfig for f in dataclasses.fields(LoRAConfig)},
        **own,
    }


def flat_defaults() -> dict[str, Any]:
    """Every flat field name -> its default, from the dataclass that owns it."""
    args = ServerArgs()
    return {
        **dataclasses.asdict(args.engine),
        **dataclasses.asdict(args.lora),
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if f.name not in ("engine", "lora")
        },
    }


def byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a K/M/G/T suffix)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _port(flag: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{flag} must be 0-65535, 0 = any free port (got {value})")


def check_server_args(args: ServerArgs) -> None:
    """The server's own flags and the combinations across objects; ValueError names the flag."""
    if args.adapter_store != "none":
        host, sep, port = args.adapter_store.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--adapter-store expects HOST:PORT or 'none' (got {args.adapter_store!r})")
    elif args.adapter_store_tls_ca:
        raise ValueError("--adapter-store-tls-ca needs --adapter-store HOST:PORT")
    if args.adapter_cache_max_bytes is not None and args.adapter_cache_max_bytes < 1:
        raise ValueError(f"--adapter-cache-max-bytes must be >= 1 (got {args.adapter_cache_max_bytes})")
    limit = args.engine.max_new_tokens_limit
    if not 1 <= args.default_max_new_tokens <= limit:
        raise ValueError(
            f"--default-max-new-tokens must be 1..--max-new-tokens-limit ({limit}) "
            f"(got {args.default_max_new_tokens})"
        )
    if args.max_inputs_per_request < 1:
        raise ValueError(f"--max-inputs-per-request must be >= 1 (got {args.max_inputs_per_request})")
    if not 1 <= args.max_message_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"--max-message-bytes must be 1..{MAX_MESSAGE_BYTES} (gRPC's 2 GiB limit less 1 MiB) "
            f"(got {args.max_message_bytes})"
        )
    if not args.host:
        raise ValueError("--host must not be empty")
    _port("--port", args.port)
    _port("--metrics-port", args.metrics_port)
    if args.metrics_port and args.metrics_port == args.port:
        raise ValueError(f"--metrics-port and --port are both {args.port}")
    if args.metrics_max_adapters < 0:
        raise ValueError(f"--metrics-max-adapters must be >= 0 (got {args.metrics_max_adapters})")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0 seconds (got {args.grace_period})")
    if any(not " " <= c <= "~" for c in args.replica_id):
        raise ValueError(
            f"--replica-id must be printable ASCII (it is sent as gRPC metadata), got {args.replica_id!r}"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    if any(not d for d in args.allowed_local_dirs):
        raise ValueError("--allowed-local-dirs entries must not be empty")
    for name in args.lora.path_map:
        if is_served_model_name(name, args.engine.model_path):
            raise ValueError(
                f"--lora-paths name {name!r} is the model's name (--model-path {args.engine.model_path}): "
                "an adapter may not shadow the model it adapts"
            )
    if args.log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {args.log_level!r})")
    if args.lora.lora_backend is not None:
        check_backend_device(args.lora.lora_backend, args.engine.device)


def _defaults(cls: type) -> argparse.Namespace:
    """A dataclass's field defaults, read without building one (nothing is resolved)."""
    return argparse.Namespace(
        **{f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    )


def build_parser() -> argparse.ArgumentParser:
    """The flags; every default comes from the dataclass that owns it."""
    p = argparse.ArgumentParser(
        prog="python -m loraplex.services.inference", description="loraplex inference service"
    )
    e, lo, s = _defaults(EngineConfig), _defaults(LoRAConfig), _defaults(ServerArgs)
    a = p.add_argument

    a("--model-path", required=True, help="HF directory or Hub id of the base model")
    a("--device", default=e.device, choices=DEVICES)
    a("--dtype", default=e.dtype, choices=DTYPES)
    a(
        "--quantization",
        default=e.quantization,
        choices=QUANTIZATIONS,
        help="fp8: hold the base model's q/k/v/o/gate/up/down weights in FP8 E4M3 (per-output-channel "
        "scales, quantized at load; adapters stay in --dtype). Pre-quantized FP8 checkpoints "
        "(compressed-tensors float-quantized, fp8 with weight_block_size) are read without it",
    )
    a(
        "--kv-cache-dtype",
        default=e.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="fp8: hold the paged KV cache in FP8 E4M3 with per-layer scales (1.0 by default; values "
        "saturate at +-448 x scale), twice the blocks of bf16 in the same memory and half the KV bytes "
        "a decode step reads (docs/operations.md, FP8 KV cache)",
    )
    a("--tp-size", type=int, default=e.tp_size)
    a("--seed", type=int, default=e.seed)
    a(
        "--lora-paths",
        nargs="*",
        default=list(lo.lora_paths),
        metavar="NAME=SOURCE",
        help="adapters to load at start (local PEFT directories; other sources via the adapter store)",
    )
    a(
        "--max-loras-per-batch",
        type=int,
        default=lo.max_loras_per_batch,
        help="at most this many distinct adapters compute in one step: hot adapters keep places while "
        "they have requests, the others take short turns (docs/architecture.md); it never sizes the GPU "
        "pool (see --max-gpu-loras), so adapters stay resident between turns. Default: every resident "
        "adapter may share a step. The base model takes no place",
    )
    a(
        "--max-gpu-loras",
        type=int,
        default=lo.max_gpu_loras,
        help="upper bound on the adapter slots of the GPU pool, which is sized from memory; default "
        f"{DEFAULT_MAX_GPU_LORAS['cuda']} on CUDA, "
        f"{DEFAULT_MAX_GPU_LORAS['cpu']} on CPU",
    )
    a(
        "--lora-backend",
        default=lo.lora_backend,
        choices=LORA_BACKENDS,
        help="default: triton on CUDA, torch on CPU",
    )
    a(
        "--max-lora-rank",
        type=int,
        default=lo.max_lora_rank,
        help="largest adapter rank the pool holds; default: the largest rank in --lora-paths, "
        f"else {DEFAULT_MAX_LORA_RANK}",
    )
    a(
        "--lora-target-modules",
        nargs="*",
        default=lo.lora_target_modules,
        help="q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or 'all'; on a mixture-of-experts "
        "base also experts.gate_up_proj experts.down_proj (not in 'all'); default: the union of "
        "--lora-paths' targets, else all",
    )
    a(
        "--expert-lora-mode",
        choices=EXPERT_LORA_MODES,
        default=lo.expert_lora_mode,
        help="LoRA on the experts: auto (graphs on CUDA where it fits: bfloat16, a max rank that is a "
        "multiple of 8; else grouped), grouped (a grouped GEMM per adapter at its own rank), span (one "
        "over the step's adapters at their largest rank), loop (per adapter and expert), graphs (no "
        "host read: CUDA graphs stay on; decode steps take a per-pair Triton kernel); the others turn "
        "CUDA graphs off",
    )
    a(
        "--disable-lora-side-stream",
        action="store_true",
        default=lo.disable_lora_side_stream,
        help="triton backend: run decode steps' LoRA kernels after each base matmul on one stream, "
        "instead of beside it on a second stream (the default on CUDA)",
    )
    a(
        "--lora-memory",
        choices=LORA_MEMORY,
        default=lo.lora_memory,
        help="where the adapter pool's rank pages live: separate (their own memory, a share sized at "
        "start) or unified (inside the KV cache's blocks, one free list: adapters grow into memory the "
        "KV cache is not using and go back to the host tier when it needs it)",
    )
    a(
        "--max-loaded-loras",
        type=int,
        default=lo.max_loaded_loras,
        help="adapters kept in host memory (LRU beyond it, re-read from source); default unbounded. "
        "Combines with --max-cpu-lora-bytes: a copy goes when either bound is exceeded",
    )
    a(
        "--max-cpu-lora-bytes",
        type=int,
        default=lo.max_cpu_lora_bytes,
        help="bytes of adapter weights kept in host memory (pinned on CUDA), the tier below the GPU "
        "pool: LRU beyond it, re-read from source (disk cache) when next needed; copies a request or "
        f"a pin holds are kept regardless. Default {CPU_LORA_MEMORY_FRACTION:g} of the host memory "
        "available at start-up",
    )
    a(
        "--lora-slot-wait",
        type=float,
        default=lo.lora_slot_wait,
        help="seconds an adapter waits for a GPU slot to free by itself before a busy one is drained "
        "for it (its requests give the slot up and resume later, KV kept); default 0.05",
    )
    a(
        "--lora-rotation-quantum",
        type=float,
        default=lo.lora_rotation_quantum,
        help="seconds an adapter keeps a GPU slot it was uploaded into before the slot may be drained "
        "for another (the rotation's quantum; raise it for large adapters whose upload takes a good "
        "part of it); default 0.1",
    )
    a("--adapter-store", default=s.adapter_store, help="HOST:PORT of the adapter store, or 'none'")
    a(
        "--adapter-cache-dir",
        default=s.adapter_cache_dir,
        help="where adapters pulled from the store are kept",
    )
    a(
        "--adapter-cache-max-bytes",
        type=byte_size,
        default=s.adapter_cache_max_bytes,
        help="bound on --adapter-cache-dir (K/M/G suffixes); least recently used adapters no loaded "
        "adapter needs are evicted to stay under it; default: half the free space of its disk at start",
    )
    a(
        "--adapter-store-tls-ca",
        default=s.adapter_store_tls_ca,
        help="PEM CA to verify a TLS adapter store with (the channel is plaintext without it); "
        "--tls-cert/--tls-key, when given, are presented to it as the client certificate (mutual TLS)",
    )
    a("--mem-fraction-static", type=float, default=e.mem_fraction_static)
    a("--max-total-tokens", type=int, default=e.max_total_tokens)
    a("--page-size", type=int, default=e.page_size)
    a("--chunked-prefill-size", type=int, default=e.chunked_prefill_size)
    a(
        "--decode-prefill-budget",
        type=int,
        default=e.decode_prefill_budget,
        help="prefill tokens per step while decodes are running (so they keep their cadence); "
        "0 = --chunked-prefill-size. Measure a choice with bench/workload.py (inter-token p99 vs TTFT)",
    )
    a("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    a("--max-running-requests", type=int, default=e.max_running_requests)
    a("--context-length", type=int, default=e.context_length)
    a("--cuda-graph-max-bs", type=int, default=e.cuda_graph_max_bs)
    a("--disable-cuda-graph", action="store_true", default=e.disable_cuda_graph)
    a(
        "--mixed-cuda-graph-max-tokens",
        type=int,
        default=e.mixed_cuda_graph_max_tokens,
        help="steps with prefill chunks of up to this many tokens replay piecewise CUDA graphs (all but "
        "attention; bounds their memory); 0 = run them eagerly",
    )
    a(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_const",
        const=False,
        default=e.overlap_schedule,
        help="run each step's output processing before launching the next step (overlap is on by "
        "default on CUDA)",
    )
    a(
        "--disable-prefix-cache",
        action="store_true",
        default=e.disable_prefix_cache,
        help="prefill every request from its first token instead of reusing the cached KV of a prefix "
        "that the same base model or adapter content computed before (on by default)",
    )
    a(
        "--grammar-cache-max-bytes",
        type=byte_size,
        default=e.grammar_cache_max_bytes,
        help="bound on the compiled grammars kept for reuse (K/M/G suffixes; their token masks, as "
        "xgrammar measures them); least recently used dropped first",
    )
    a(
        "--grammar-max-bytes",
        type=byte_size,
        default=e.grammar_max_bytes,
        help="bound on one compiled grammar (K/M/G suffixes): a constraint that compiles to more is "
        "refused with INVALID_ARGUMENT (at most --grammar-cache-max-bytes)",
    )
    a(
        "--speculative-algorithm",
        choices=SPECULATIVE_ALGORITHMS,
        default=e.speculative_algorithm,
        help="speculative decoding: 'ngram' drafts each request's next tokens from its own prompt and "
        "output, 'draft' with --speculative-draft-model-path; the drafts are verified in one step, each "
        "position with its request's adapter (off by default; a step that drafts runs without overlap "
        "scheduling)",
    )
    a(
        "--speculative-draft-model-path",
        default=e.speculative_draft_model_path,
        help="the draft model of --speculative-algorithm draft: a smaller model with this model's "
        "tokenizer (a local directory or a Hub id; its vocabulary size must match)",
    )
    a(
        "--speculative-draft-lora-paths",
        nargs="*",
        default=list(e.speculative_draft_lora_paths),
        metavar="NAME=DIR",
        help="LoRA adapters of the draft model, loaded at start; a request names one as its "
        "draft_adapter (each keeps a slot of the draft's own adapter pool)",
    )
    a(
        "--speculative-num-draft-tokens",
        type=int,
        default=e.speculative_num_draft_tokens,
        help="draft tokens verified per request per step (K)",
    )
    a(
        "--speculative-disable-batch-size",
        type=int,
        default=e.speculative_disable_batch_size,
        help="no speculation in a step with more running requests than this",
    )
    a("--max-new-tokens-limit", type=int, default=e.max_new_tokens_limit)
    a("--default-max-new-tokens", type=int, default=s.default_max_new_tokens)
    a("--max-inputs-per-request", type=int, default=s.max_inputs_per_request)
    a("--max-message-bytes", type=int, default=s.max_message_bytes)
    a("--max-queued-requests", type=int, default=e.max_queued_requests)
    a("--host", default=s.host)
    a("--port", type=int, default=s.port)
    a("--metrics-port", type=int, default=s.metrics_port)
    a(
        "--metrics-max-adapters",
        type=int,
        default=s.metrics_max_adapters,
        help="adapters with per-adapter metric series of their own (others are counted as _other); "
        "an adapter's series go once it is neither loaded nor busy here",
    )
    a("--grace-period", type=float, default=s.grace_period)
    a(
        "--listen-when-ready",
        action="store_true",
        default=s.listen_when_ready,
        help="bind the port only once the model is loaded and warmed up (replicas behind nginx, which has "
        "no active health checks: a loading replica then refuses connections and is routed around)",
    )
    a(
        "--replica-id",
        default=s.replica_id,
        help="this replica's name, sent on every response as trailing metadata x-loraplex-replica "
        "(default: the hostname)",
    )
    a(
        "--admin-token",
        default=s.admin_token,
        help="LoadAdapter/UnloadAdapter need 'authorization: Bearer <token>'; also sent to the store "
        "(default: $LORAPLEX_ADMIN_TOKEN; the environment keeps it out of `ps`)",
    )
    a(
        "--api-token",
        default=s.api_token,
        help="every Inference call needs 'authorization: Bearer <token>' (default: $LORAPLEX_API_TOKEN)",
    )
    a("--tls-cert", default=s.tls_cert, help="PEM server certificate (with --tls-key): serve TLS")
    a("--tls-key", default=s.tls_key, help="PEM private key of --tls-cert")
    a("--tls-ca", default=s.tls_ca, help="PEM CA: clients must present a certificate it signed (mutual TLS)")
    a(
        "--allowed-local-dirs",
        nargs="*",
        default=list(s.allowed_local_dirs),
        help="LoadAdapter local-path sources only under these directories (default: anywhere)",
    )
    a("--log-level", type=str.lower, default=s.log_level, choices=LOG_LEVELS)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and check the command line; a bad flag exits with status 2 and a message naming it."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    if not values["model_path"]:
        parser.error("--model-path must not be empty")
    values["admin_token"] = values["admin_token"] or os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    values["api_token"] = values["api_token"] or os.environ.get("LORAPLEX_API_TOKEN") or None
    for key in ("lora_paths", "allowed_local_dirs", "speculative_draft_lora_paths"):
        values[key] = tuple(values[key])
    if values["lora_target_modules"] is not None:
        values["lora_target_modules"] = tuple(values["lora_target_modules"])
    try:
        return ServerArgs.from_fields(**values)
    except ValueError as exc:
        parser.error(str(exc))
