"""The checks `ServerArgs` runs when it is built: the server's own flags, and the combinations
across it, `EngineConfig` and `LoRAConfig`. A ValueError names the flag; `parse_args`
(server_flags.py) turns it into a usage error (exit status 2) before the model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.services.inference.lora.names import is_served_model_name
from loraplex.services.inference.lora.settings import check_backend_device

if TYPE_CHECKING:
    from loraplex.services.inference.server_args import ServerArgs

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# gRPC caps a message at 2 GiB - 1; the server's own limit sits 1 MiB above --max-message-bytes.
MAX_MESSAGE_BYTES = (1 << 31) - 1 - (1 << 20)


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
