"""One channel to the adapter store and its calls, each failure mapped to the engine's errors.

`StoreConnection` is the plain gRPC client: GetAdapter, RegisterAdapter, DeleteAdapter,
ListAdapters, and the PullAdapter / WatchAdapters streams (store_client.py writes a pull into the
cache, store_watch.py follows the watch). The store's admin token goes on every call.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from loraplex.services.inference.errors import (
    AdapterIncompatible,
    AdapterInvalid,
    AdapterNotFound,
    BackendUnavailable,
    LoraplexError,
)
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc

# A restarted store is found again within a second (grpc's default backoff grows to 2 min).
STORE_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# How long a cold lookup waits for the store's connection before answering UNAVAILABLE.
CONNECT_WAIT_S = 3.0


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS to the store when `ca` is given; `cert`/`key` are the client certificate for mutual TLS."""
    if not ca:
        return None
    pair = (Path(key).read_bytes(), Path(cert).read_bytes()) if cert and key else (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(), private_key=pair[0], certificate_chain=pair[1]
    )


def map_rpc_error(err: grpc.RpcError, name: str, what: str) -> LoraplexError:
    """A failed store call (`what`, about adapter `name`) as the engine's error: NOT_FOUND is
    AdapterNotFound, a refusal AdapterInvalid / AdapterIncompatible, anything else
    BackendUnavailable."""
    code = err.code()
    detail = err.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFound(
            f"adapter {name!r} is not loaded here and not in the adapter store", adapter=name
        )
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        cls = AdapterInvalid if code == grpc.StatusCode.INVALID_ARGUMENT else AdapterIncompatible
        return cls(f"adapter store rejected {name!r}: {detail}", adapter=name)
    return BackendUnavailable(
        f"adapter store {what} for {name!r} failed ({code.name}): {detail}", adapter=name
    )


class StoreConnection:
    """Talks to one adapter store at `target` (HOST:PORT); the calls are coroutines, the streams
    are returned open."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=STORE_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=STORE_CHANNEL_OPTIONS)
        self._stub = pb_grpc.AdapterStoreStub(self._channel)
        # The store's admin token (its RegisterAdapter/DeleteAdapter need it), sent on every call.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def close(self) -> None:
        await self._channel.close()

    async def get(self, name: str, timeout: float = CONNECT_WAIT_S) -> pb.AdapterRecord:
        try:
            req = pb.GetAdapterRequest(name=name)
            # wait_for_ready rides out a reconnect instead of failing at once while it backs off
            return await self._stub.GetAdapter(
                req, timeout=timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as err:
            raise map_rpc_error(err, name, "GetAdapter") from None

    async def register(
        self, name: str, source: str, revision: str = "", timeout: float = 600.0
    ) -> pb.AdapterRecord:
        try:
            req = pb.RegisterAdapterRequest(name=name, source=source, revision=revision)
            return await self._stub.RegisterAdapter(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                raise AdapterNotFound(
                    f"adapter source {source!r} not found: {err.details()}", adapter=name
                ) from None
            raise map_rpc_error(err, name, "RegisterAdapter") from None

    async def delete(self, name: str, timeout: float = 30.0) -> bool:
        """Delete the adapter from the store (every replica drops it via WatchAdapters); False if
        the store had no such adapter."""
        try:
            req = pb.DeleteAdapterRequest(name=name)
            return (await self._stub.DeleteAdapter(req, timeout=timeout, metadata=self._metadata)).deleted
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise map_rpc_error(err, name, "DeleteAdapter") from None

    async def list_page(self, page_size: int, after: str = "") -> tuple[list[pb.AdapterRecord], str]:
        """Up to `page_size` records named after `after`, in name order, and the next page's token."""
        try:
            req = pb.ListStoreAdaptersRequest(page_size=page_size, page_token=after)
            resp = await self._stub.ListAdapters(req, timeout=10.0, metadata=self._metadata)
        except grpc.RpcError as err:
            raise map_rpc_error(err, "*", "ListAdapters") from None
        return list(resp.adapters), resp.next_page_token

    async def list(self) -> list[pb.AdapterRecord]:
        out: list[pb.AdapterRecord] = []
        token = ""
        while True:
            page, token = await self.list_page(1000, token)
            out.extend(page)
            if not token:
                return out

    def pull_stream(self, name: str) -> grpc.aio.UnaryStreamCall:
        """A PullAdapter stream: its header, then the weights in chunks."""
        return self._stub.PullAdapter(
            pb.PullAdapterRequest(name=name), timeout=600.0, metadata=self._metadata
        )

    def open_watch(self, last_event_id: str) -> grpc.aio.UnaryStreamCall:
        """A WatchAdapters stream from `last_event_id` (store_watch.py follows it)."""
        req = pb.WatchAdaptersRequest(last_event_id=last_event_id)
        return self._stub.WatchAdapters(req, metadata=self._metadata)
