"""Command-line flags of `python -m services.inference`, as one frozen dataclass.

Flag names and defaults follow SGLang's where SGLang has one (design brief §5).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

ALL_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = ""
    # Model / device
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    tp_size: int = 1
    seed: int = 0
    # LoRA
    lora_paths: tuple[str, ...] = ()  # NAME=SOURCE
    max_loras_per_batch: int | None = None  # None: pool sized from memory, every resident adapter per batch
    max_gpu_loras: int | None = None  # bound on a pool sized from memory; None = 256 on CUDA, 64 on CPU
    lora_backend: str | None = None  # triton | torch; None = triton on CUDA, torch on CPU
    disable_lora_side_stream: bool = False  # triton on CUDA: decode deltas beside the base matmul
    max_lora_rank: int | None = None  # None = inferred from lora_paths, else 64
    lora_target_modules: tuple[str, ...] | None = None  # None = inferred, else all
    max_loaded_loras: int | None = None  # host cache size; None = unbounded
    adapter_store: str = "none"  # HOST:PORT | none
    adapter_cache_dir: str | None = None  # adapters pulled from the store; None = ~/.cache/loraplex/inference
    adapter_store_tls_ca: str | None = None  # PEM: talk TLS to the store, verified with it
    # Memory and batching
    mem_fraction_static: float = 0.88
    max_total_tokens: int | None = None
    page_size: int = 16
    chunked_prefill_size: int = 2048
    decode_prefill_budget: int = 0  # prefill tokens per step while decodes run; 0 = --chunked-prefill-size
    max_num_batched_tokens: int = 8192
    max_running_requests: int = 256
    context_length: int | None = None
    cuda_graph_max_bs: int = 256
    disable_cuda_graph: bool = False
    mixed_cuda_graph_max_tokens: int = 2048  # piecewise graphs for steps with prefill chunks; 0 = off
    disable_overlap_schedule: bool = False  # overlap is on by default on CUDA (off on CPU)
    disable_prefix_cache: bool = False
    # Request limits
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 128
    max_inputs_per_request: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    max_queued_requests: int = 4096
    # Server
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
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

    @property
    def lora_path_map(self) -> dict[str, str]:
        # Imported here: proto_convert imports this module.
        from services.inference.proto_convert import ADAPTER_NAME_RE

        out: dict[str, str] = {}
        for item in self.lora_paths:
            name, sep, source = item.partition("=")
            if not sep or not name or not source:
                raise ValueError(f"--lora-paths expects NAME=SOURCE, got {item!r}")
            if not ADAPTER_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"--lora-paths name {name!r} is invalid: use 1-128 characters from "
                    "[A-Za-z0-9._-], starting with a letter or digit (requests could not name it)"
                )
            out[name] = source
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.inference", description="loraplex inference service")
    d = ServerArgs()
    a = p.add_argument
    a("--model-path", required=True, help="HF directory or Hub id of the base model")
    a("--device", default=d.device, choices=["auto", "cuda", "cpu"])
    a("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"])
    a("--tp-size", type=int, default=d.tp_size)
    a("--seed", type=int, default=d.seed)
    a(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="NAME=SOURCE",
        help="adapters to load at start (local PEFT directories; other sources via the adapter store)",
    )
    a(
        "--max-loras-per-batch",
        type=int,
        default=None,
        help="at most this many distinct adapters in one batch (the GPU pool then has this many slots); "
        "default: the pool is sized from free memory (see --max-gpu-loras) and every resident adapter may "
        "share a batch. The base model takes no slot",
    )
    a(
        "--max-gpu-loras",
        type=int,
        default=None,
        help="upper bound on the adapter slots of a pool sized from memory (without --max-loras-per-batch); "
        "default 256 on CUDA, 64 on CPU",
    )
    a(
        "--lora-backend",
        default=None,
        choices=["triton", "torch"],
        help="default: triton on CUDA, torch on CPU",
    )
    a(
        "--max-lora-rank",
        type=int,
        default=None,
        help="largest adapter rank the pool holds; default: the largest rank in --lora-paths, else 64",
    )
    a(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or 'all'; default: the union of "
        "--lora-paths' targets, else all",
    )
    a(
        "--disable-lora-side-stream",
        action="store_true",
        help="triton backend: run decode steps' LoRA kernels after each base matmul on one stream, "
        "instead of beside it on a second stream (the default on CUDA)",
    )
    a(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapters kept in host memory (LRU beyond it, re-read from source); default unbounded",
    )
    a("--adapter-store", default=d.adapter_store, help="HOST:PORT of the adapter store, or 'none'")
    a("--adapter-cache-dir", default=None, help="where adapters pulled from the store are kept")
    a(
        "--adapter-store-tls-ca",
        default=None,
        help="PEM CA to verify a TLS adapter store with (the channel is plaintext without it); "
        "--tls-cert/--tls-key, when given, are presented to it as the client certificate (mutual TLS)",
    )
    a("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    a("--max-total-tokens", type=int, default=None)
    a("--page-size", type=int, default=d.page_size)
    a("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    a(
        "--decode-prefill-budget",
        type=int,
        default=d.decode_prefill_budget,
        help="prefill tokens per step while decodes are running (so they keep their cadence); "
        "0 = --chunked-prefill-size. Pick it from bench/mixed_step.py's step time vs chunk size",
    )
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a("--context-length", type=int, default=None)
    a("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs)
    a("--disable-cuda-graph", action="store_true")
    a(
        "--mixed-cuda-graph-max-tokens",
        type=int,
        default=d.mixed_cuda_graph_max_tokens,
        help="steps with prefill chunks of up to this many tokens replay piecewise CUDA graphs (all but "
        "attention; bounds their memory); 0 = run them eagerly",
    )
    a(
        "--disable-overlap-schedule",
        action="store_true",
        help="run each step's output processing before launching the next step (overlap is on by default on CUDA)",
    )
    a(
        "--disable-prefix-cache",
        action="store_true",
        help="prefill every request from its first token instead of reusing the cached KV of a prefix "
        "that the same base model or adapter content computed before (on by default)",
    )
    a("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit)
    a("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    a("--max-inputs-per-request", type=int, default=d.max_inputs_per_request)
    a("--max-message-bytes", type=int, default=d.max_message_bytes)
    a("--max-queued-requests", type=int, default=d.max_queued_requests)
    a("--host", default=d.host)
    a("--port", type=int, default=d.port)
    a("--metrics-port", type=int, default=None)
    a("--grace-period", type=float, default=d.grace_period)
    a(
        "--listen-when-ready",
        action="store_true",
        help="bind the port only once the model is loaded and warmed up (replicas behind nginx, which has "
        "no active health checks: a loading replica then refuses connections and is routed around)",
    )
    a(
        "--replica-id",
        default="",
        help="this replica's name, sent on every response as trailing metadata x-loraplex-replica "
        "(default: the hostname)",
    )
    a(
        "--admin-token",
        default=None,
        help="LoadAdapter/UnloadAdapter need 'authorization: Bearer <token>'; also sent to the store "
        "(default: $LORAPLEX_ADMIN_TOKEN; the environment keeps it out of `ps`)",
    )
    a(
        "--api-token",
        default=None,
        help="every Inference call needs 'authorization: Bearer <token>' (default: $LORAPLEX_API_TOKEN)",
    )
    a("--tls-cert", default=None, help="PEM server certificate (with --tls-key): serve TLS")
    a("--tls-key", default=None, help="PEM private key of --tls-cert")
    a("--tls-ca", default=None, help="PEM CA: clients must present a certificate it signed (mutual TLS)")
    a(
        "--allowed-local-dirs",
        nargs="*",
        default=[],
        help="LoadAdapter local-path sources only under these directories (default: anywhere)",
    )
    a("--log-level", default=d.log_level)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["admin_token"] = values["admin_token"] or os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    values["api_token"] = values["api_token"] or os.environ.get("LORAPLEX_API_TOKEN") or None
    for key in ("lora_paths", "allowed_local_dirs"):
        values[key] = tuple(values[key])
    if values["lora_target_modules"] is not None:
        values["lora_target_modules"] = tuple(values["lora_target_modules"])
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    args = ServerArgs(**{k: v for k, v in values.items() if k in names})
    args.lora_path_map  # noqa: B018 - validates NAME=SOURCE early
    return args
