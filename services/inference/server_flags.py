"""The command line of `python -m loraplex.services.inference`: the argparse parser and `parse_args`.

Every default comes from the dataclass that owns the flag (`EngineConfig`, `LoRAConfig`,
`ServerArgs`); the LoRA flags are lora_flags.py's. `parse_args` fills the tokens from the
environment and checks every flag (ranges, choices and combinations: building `ServerArgs` runs
server_args_checks.py) so a bad command line fails before the model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from loraplex.services.inference.engine.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    EngineConfig,
)
from loraplex.services.inference.lora.settings import LoRAConfig
from loraplex.services.inference.lora_flags import add_lora_flags
from loraplex.services.inference.server_args import ServerArgs
from loraplex.services.inference.server_args_checks import LOG_LEVELS


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
    add_lora_flags(p, lo)
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
