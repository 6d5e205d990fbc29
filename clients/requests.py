"""Request building shared by the sync and asyncio clients, and the channel settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from loraplex.v1 import inference_pb2 as pb

# A long unary Generate sends nothing for its whole run; keepalive pings keep idle-killing
# proxies and NATs from dropping it. The server permits a ping every 10 s (services/inference/server.py).
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # find a restarted server within a second (grpc's default backoff grows to 2 minutes)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


def generate_request(texts: str | Sequence[str], adapters: str | Sequence[str] | None = None,
                     **sampling: Any) -> pb.GenerateRequest:
    """`texts` one prompt or many; `adapters` one name for all, one per text, or None for the base model.

    `sampling` takes SamplingParams' field names (max_new_tokens, temperature, top_p, ...).
    """
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    text_list = [texts] if isinstance(texts, str) else list(texts)
    if adapters is None:
        adapter_list: list[str] = []
    elif isinstance(adapters, str):
        adapter_list = [adapters]
    else:
        adapter_list = ["" if a is None else a for a in adapters]
    params = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in sampling.items() if v is not None}
    return pb.GenerateRequest(text=text_list, adapter=adapter_list, sampling_params=pb.SamplingParams(**params))


def make_channel(target: str, *, tls_ca: str | None = None, aio: bool = False):
    """A channel with CHANNEL_OPTIONS; TLS (verified against `tls_ca`, a PEM file) when given."""
    module = grpc.aio if aio else grpc
    if tls_ca is None:
        return module.insecure_channel(target, options=CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    return module.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata for a server started with --api-token / --admin-token."""
    return (("authorization", f"Bearer {token}"),) if token else None
