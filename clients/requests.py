"""Request building shared by the sync and asyncio clients, and the channel settings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2_grpc

from loraplex.v1 import adapter_store_pb2_grpc, inference_pb2_grpc
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

# A call answered UNAVAILABLE before any response (a router whose replica died under it, a
# draining server) is repeated, up to 3 attempts: gRPC's own retry, which never repeats a call
# once a response message has arrived, so a stream that has sent tokens is not replayed.
RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "loraplex.v1.Inference"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)
CHANNEL_OPTIONS.append(("grpc.service_config", RETRY_SERVICE_CONFIG))

SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


def generate_request(
    texts: str | Sequence[str], adapters: str | Sequence[str] | None = None, **sampling: Any
) -> pb.GenerateRequest:
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
    params = {
        k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in sampling.items() if v is not None
    }
    return pb.GenerateRequest(
        text=text_list, adapter=adapter_list, sampling_params=pb.SamplingParams(**params)
    )


def inputs_request(
    inputs: Sequence[pb.Input | dict[str, Any]], adapter: str | None = None, **sampling: Any
) -> pb.GenerateRequest:
    """Inputs of any form: `pb.Input`s or dicts with Input's field names, e.g.
    `{"token_ids": [...]}`, `{"messages": [{"role": "user", "content": "hi"}], "adapter": "sql",
    "sampling_params": {"temperature": 0.7}}`. `adapter`: the default for inputs that name none."""
    base = generate_request([], adapter, **sampling)
    for item in inputs:
        base.inputs.append(item if isinstance(item, pb.Input) else json_format.ParseDict(item, pb.Input()))
    return base


def chat_request(
    messages: Sequence[dict[str, str]],
    adapter: str | None = None,
    *,
    add_generation_prompt: bool = True,
    **sampling: Any,
) -> pb.GenerateRequest:
    """One chat, rendered by the server with the model's (or the adapter's) chat template."""
    item = {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
    return inputs_request([item], adapter, **sampling)


ADAPTER_HEADER = "x-loraplex-adapter"


def routing_metadata(
    metadata: tuple[tuple[str, str], ...] | None, adapters: Sequence[str]
) -> tuple[tuple[str, str], ...] | None:
    """`metadata` plus `x-loraplex-adapter: NAME`, the first adapter the call names, which a router
    (deploy/nginx) hashes to keep each adapter on one replica; base-model calls send none."""
    name = next((a for a in adapters if a), "")
    if not name:
        return metadata
    return (*(metadata or ()), (ADAPTER_HEADER, name))


def make_channel(
    target: str,
    *,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    aio: bool = False,
):
    """A channel with CHANNEL_OPTIONS; TLS (verified against `tls_ca`, a PEM file) when given,
    presenting `tls_cert`/`tls_key` as the client certificate to a server that requires one."""
    module = grpc.aio if aio else grpc
    if tls_ca is None:
        return module.insecure_channel(target, options=CHANNEL_OPTIONS)
    key, chain = (
        (Path(tls_key).read_bytes(), Path(tls_cert).read_bytes()) if tls_cert and tls_key else (None, None)
    )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(), private_key=key, certificate_chain=chain
    )
    return module.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata for a server started with --api-token / --admin-token."""
    return (("authorization", f"Bearer {token}"),) if token else None


class ClientBase:
    """Channels and stubs shared by the sync `Client` and the asyncio `AsyncClient`."""

    _aio = False

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        store: str | None = None,
        timeout: float | None = None,
        token: str | None = None,
        store_token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        """`token`: the server's --api-token (or --admin-token for LoadAdapter/UnloadAdapter);
        `store_token`: the store's admin token; `tls_ca`: PEM to verify TLS servers with;
        `tls_cert`/`tls_key`: this client's certificate for servers started with --tls-ca."""
        tls = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.timeout = timeout
        self._md = bearer(token)
        self._store_md = bearer(store_token)
        self._channel = make_channel(target, **tls, aio=self._aio)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._store_channel = make_channel(store, **tls, aio=self._aio) if store else None
        self._store = (
            adapter_store_pb2_grpc.AdapterStoreStub(self._store_channel) if self._store_channel else None
        )
