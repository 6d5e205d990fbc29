"""The FastAPI app: each HTTP call is one gRPC call to `--target` (backend.py); streams are
server-sent events. Here the app is built: its error handlers (every error in OpenAI's shape),
`/health`, `/metrics`, and the route families, each in its own module: completion_routes.py
(completions and chat), models_route.py, responses_route.py (the Responses API), vllm_routes.py
(vLLM's operational routes).

Work whose time grows with a request (reading its JSON body, building and encoding the answer,
parsing tool calls out of the output) runs in worker threads, never on the event loop, so one caller's
big request or long output cannot hold up the others (`/health` included).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from loraplex.services.openai import completion_routes, models_route, responses_route, vllm_routes
from loraplex.services.openai.backend import Backend
from loraplex.services.openai.door_metrics import DoorMetrics
from loraplex.services.openai.errors import OpenAIError, bad_request


def create_app(backend: Backend, admin_token: str | None = None) -> FastAPI:
    """The door's routes; `admin_token` ($LORAPLEX_ADMIN_TOKEN) switches on vLLM's adapter routes."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(
        title="loraplex OpenAI-compatible API",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.backend = backend
    app.add_middleware(DoorMetrics)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes (404), wrong methods (405) and the like, in OpenAI's error shape."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message, code = f"Invalid URL ({where}): this server has no such route", "unknown_url"
        elif exc.status_code == 405:
            message, code = f"Method not allowed ({where})", "method_not_allowed"
        else:
            message, code = f"{exc.detail} ({where})", None
        err = OpenAIError(exc.status_code, message, code=code)
        response = err.response()
        for name, value in (exc.headers or {}).items():  # e.g. 405's Allow
            response.headers[name] = value
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")) or None
        return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param).response()

    @app.exception_handler(Exception)
    async def _unforeseen(request: Request, exc: Exception) -> Response:
        # A bug: OpenAI's error shape rather than a bare 500 page. Starlette re-raises the exception
        # after this response is sent, so uvicorn logs its traceback.
        return OpenAIError(
            500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error"
        ).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = _door_metrics(app).exposition()
        return Response(body, media_type=content_type)

    vllm_routes.add_routes(app, backend, admin_token)
    responses_route.add_route(app, backend)
    models_route.add_routes(app, backend)
    completion_routes.add_routes(app, backend)
    return app


def _door_metrics(app: FastAPI) -> DoorMetrics:
    """The metrics middleware instance of `app` (built by Starlette when the app starts)."""
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, DoorMetrics):
        layer = getattr(layer, "app", None)
    if layer is None:
        raise RuntimeError("the door's metrics middleware is not in the stack")
    return layer
