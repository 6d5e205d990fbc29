"""`GET /v1/models` and `GET /v1/models/{id}`: the base model (under its first name) and every
adapter the server lists, each adapter's `parent` the base and its `root` where it came from."""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from loraplex.services.openai.backend import Backend, call_metadata
from loraplex.services.openai.errors import from_grpc, model_not_found
from loraplex.services.openai.responses import public_source
from loraplex.v1 import inference_pb2 as pb


def add_routes(app: FastAPI, backend: Backend) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await model_list(request)})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        for entry in await model_list(request):
            if entry["id"] == model_id:
                return JSONResponse(entry)
        raise model_not_found(model_id)

    async def model_list(request: Request) -> list[dict]:
        md = call_metadata(request)
        try:
            base = (await backend.base_names(md))[0]
            adapters: list[pb.AdapterInfo] = []
            token = ""
            while True:  # ListAdapters pages (1000 a page)
                page = await backend.stub.ListAdapters(
                    pb.ListAdaptersRequest(page_token=token), metadata=md, timeout=30
                )
                adapters.extend(page.adapters)
                if not (token := page.next_page_token):
                    break
        except grpc.RpcError as exc:
            raise from_grpc(exc, "") from None
        data = [
            {
                "id": base,
                "object": "model",
                "created": 0,
                "owned_by": "loraplex",
                "root": base,
                "parent": None,
            }
        ]
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": 0,
                "owned_by": "loraplex",
                "root": public_source(a.source, a.name),
                "parent": base,
            }
            for a in adapters
        ]
        return data
