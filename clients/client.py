"""Synchronous Python client for the inference service and the adapter store.

    from loraplex.clients import Client
    with Client("127.0.0.1:50051", store="127.0.0.1:50052") as c:
        [out] = c.generate("List 3 countries and their capitals.", adapter="sql", max_new_tokens=64)

Failed calls raise the typed exceptions of clients/errors.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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


class Client(ClientBase):
    _aio = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._store_channel is not None:
            self._store_channel.close()

    def _call(self, method, request, timeout: float | None, metadata=None):
        try:
            timeout = timeout if timeout is not None else self.timeout
            return method(request, timeout=timeout, metadata=self._md if metadata is None else metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    # -- inference --------------------------------------------------------------------------
    def generate(
        self,
        texts: str | Sequence[str],
        adapter: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        request = generate_request(texts, adapter, **sampling)
        md = routing_metadata(self._md, request.adapter)
        return list(self._call(self._stub.Generate, request, timeout, md).completions)

    def generate_request(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> list[pb.Completion]:
        """A ready GenerateRequest (e.g. from clients/requests.py)."""
        return list(self._call(self._stub.Generate, request, timeout).completions)

    def generate_inputs(
        self,
        inputs: Sequence[pb.Input | dict[str, Any]],
        adapter: str | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        """Inputs as text, token ids or chat messages, each with its own adapter and sampling params
        (clients/requests.inputs_request); completions in input order, then sample order."""
        request = inputs_request(inputs, adapter, **sampling)
        return list(self._call(self._stub.Generate, request, timeout).completions)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        adapter: str | None = None,
        *,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
        **sampling: Any,
    ) -> list[pb.Completion]:
        """One chat (`[{"role": ..., "content": ...}, ...]`); `n` > 1 gives several answers."""
        request = chat_request(messages, adapter, add_generation_prompt=add_generation_prompt, **sampling)
        return list(self._call(self._stub.Generate, request, timeout).completions)

    def generate_stream(
        self,
        texts: str | Sequence[str] | pb.GenerateRequest,
        adapter: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[pb.GenerateStreamResponse]:
        """`texts` may also be a ready GenerateRequest (e.g. from requests.inputs_request / chat_request)."""
        request = (
            texts if isinstance(texts, pb.GenerateRequest) else generate_request(texts, adapter, **sampling)
        )
        stream = self._stub.GenerateStream(
            request,
            timeout=timeout if timeout is not None else self.timeout,
            metadata=routing_metadata(self._md, request.adapter),
        )
        try:
            yield from stream
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            stream.cancel()  # no-op when finished; frees the server's work when the caller stops early

    def load_adapter(
        self, name: str, source: str, revision: str = "", pin: bool = False, *, timeout: float | None = None
    ) -> pb.AdapterInfo:
        req = pb.LoadAdapterRequest(name=name, source=source, revision=revision, pin=pin)
        return self._call(self._stub.LoadAdapter, req, timeout, routing_metadata(self._md, [name])).adapter

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        self._call(
            self._stub.UnloadAdapter,
            pb.UnloadAdapterRequest(name=name),
            timeout,
            routing_metadata(self._md, [name]),
        )

    def list_adapters(self, *, timeout: float | None = None) -> list[pb.AdapterInfo]:
        """Every adapter, page by page (ListAdapters answers at most 1000 at a time)."""
        out: list[pb.AdapterInfo] = []
        token = ""
        while True:
            resp = self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(page_token=token), timeout)
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        return list(self._call(self._stub.Tokenize, pb.TokenizeRequest(text=text), timeout).token_ids)

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... of the inference server."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # -- adapter store ----------------------------------------------------------------------
    def _store_stub(self) -> spb_grpc.AdapterStoreStub:
        if self._store is None:
            raise ValueError("this client has no store address (Client(..., store='HOST:PORT'))")
        return self._store

    def register_adapter(
        self, name: str, source: str, revision: str = "", *, timeout: float | None = None
    ) -> spb.AdapterRecord:
        req = spb.RegisterAdapterRequest(name=name, source=source, revision=revision)
        return self._call(self._store_stub().RegisterAdapter, req, timeout, self._store_md or ())

    def get_adapter(self, name: str, *, timeout: float | None = None) -> spb.AdapterRecord:
        req = spb.GetAdapterRequest(name=name)
        return self._call(self._store_stub().GetAdapter, req, timeout, self._store_md or ())

    def list_store_adapters(self, *, timeout: float | None = None) -> list[spb.AdapterRecord]:
        out, token = [], ""
        while True:
            req = spb.ListStoreAdaptersRequest(page_token=token)
            resp = self._call(self._store_stub().ListAdapters, req, timeout, self._store_md or ())
            out.extend(resp.adapters)
            token = resp.next_page_token
            if not token:
                return out

    def delete_adapter(self, name: str, *, timeout: float | None = None) -> bool:
        req = spb.DeleteAdapterRequest(name=name)
        return self._call(self._store_stub().DeleteAdapter, req, timeout, self._store_md or ()).deleted
