"""asyncio Python client: the same calls as loraplex.clients.client.Client, as coroutines.

async with AsyncClient("127.0.0.1:50051") as c:
    async for delta in c.generate_stream(["a", "b"], adapter=["x", ""]):
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from loraplex.clients.errors import from_rpc_error
from loraplex.clients.requests import (
    ClientBase,
    chat_request,
    generate_request,
    inputs_request,
    routing_metadata,
)
from loraplex.v1 import adapter_store_pb2 as spb
from loraplex.v1 import adapter_store_pb2_grpc as spb_grpc
from loraplex.v1 import inference_pb2 as pb


class AsyncClient(ClientBase):
    _aio = True

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._store_channel is not None:
            await self._store_channel.close()

    async def _call(self, method, request, timeout: float | None, metadata=None):
        try:
            timeout = timeout if timeout is not None else self.timeout
            return await method(request, timeout=timeout, metadata=self._md if metadata is None else metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def generate(
        self,
        texts: str | Sequence[str],
        adapter: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        request = generate_request(texts, adapter, **sampling)
        md = routing_metadata(self._md, request.adapter)
        return list((await self._call(self._stub.Generate, request, timeout, md)).completions)

    async def generate_inputs(
        self,
        inputs: Sequence[pb.Input | dict[str, Any]],
        adapter: str | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        request = inputs_request(inputs, adapter, **sampling)
        return list((await self._call(self._stub.Generate, request, timeout)).completions)

    async def chat(
        self,
        messages: Sequence[dict[str, str]],
        adapter: str | None = None,
        *,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        request = chat_request(messages, adapter, add_generation_prompt=add_generation_prompt, **sampling)
        return list((await self._call(self._stub.Generate, request, timeout)).completions)

    async def generate_stream(
        self,
        texts: str | Sequence[str] | pb.GenerateRequest,
        adapter: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        request = (
            texts if isinstance(texts, pb.GenerateRequest) else generate_request(texts, adapter, **sampling)
        )
        call = self._stub.GenerateStream(
            request,
            timeout=timeout if timeout is not None else self.timeout,
            metadata=routing_metadata(self._md, request.adapter),
        )
        try:
            async for message in call:
                yield message
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def load_adapter(
        self, name: str, source: str, revision: str = "", pin: bool = False, *, timeout: float | None = None
    ) -> pb.AdapterInfo:
        req = pb.LoadAdapterRequest(name=name, source=source, revision=revision, pin=pin)
        return (
            await self._call(self._stub.LoadAdapter, req, timeout, routing_metadata(self._md, [name]))
        ).adapter

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        await self._call(
            self._stub.UnloadAdapter,
            pb.UnloadAdapterRequest(name=name),
            timeout,
            routing_metadata(self._md, [name]),
        )

    async def list_adapters(self, *, timeout: float | None = None) -> list[pb.AdapterInfo]:
        """Every adapter, page by page (ListAdapters answers at most 1000 at a time)."""
        out: list[pb.AdapterInfo] = []
        token = ""
        while True:
            req = pb.ListAdaptersRequest(page_token=token)
            resp = await self._call(self._stub.ListAdapters, req, timeout)
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        return list((await self._call(self._stub.Tokenize, pb.TokenizeRequest(text=text), timeout)).token_ids)

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        resp = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _store_stub(self) -> spb_grpc.AdapterStoreStub:
        if self._store is None:
            raise ValueError("this client has no store address (AsyncClient(..., store='HOST:PORT'))")
        return self._store

    async def register_adapter(
        self, name: str, source: str, revision: str = "", *, timeout: float | None = None
    ) -> spb.AdapterRecord:
        req = spb.RegisterAdapterRequest(name=name, source=source, revision=revision)
        return await self._call(self._store_stub().RegisterAdapter, req, timeout, self._store_md or ())

    async def get_adapter(self, name: str, *, timeout: float | None = None) -> spb.AdapterRecord:
        req = spb.GetAdapterRequest(name=name)
        return await self._call(self._store_stub().GetAdapter, req, timeout, self._store_md or ())

    async def list_store_adapters(self, *, timeout: float | None = None) -> list[spb.AdapterRecord]:
        out, token = [], ""
        while True:
            req = spb.ListStoreAdaptersRequest(page_token=token)
            resp = await self._call(self._store_stub().ListAdapters, req, timeout, self._store_md or ())
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    async def delete_adapter(self, name: str, *, timeout: float | None = None) -> bool:
        req = spb.DeleteAdapterRequest(name=name)
        return (
            await self._call(self._store_stub().DeleteAdapter, req, timeout, self._store_md or ())
        ).deleted
