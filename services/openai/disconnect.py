"""A unary gRPC call raced against its HTTP client going away: the client leaving cancels the call,
which aborts its engine requests and frees their KV, as a stream's client leaving already does."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from loraplex.services.openai.errors import OpenAIError


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: `receive` has nothing else)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _result(awaitable):
    return await awaitable


async def unless_client_leaves(request: Request, call, awaitable=None):
    """What `awaitable` (default: the unary `call` itself; a stream's first `call.read()`) gives,
    or the call cancelled and a 499 raised when the client leaves first."""
    answer = asyncio.ensure_future(_result(call if awaitable is None else awaitable))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            call.cancel()
            answer.cancel()
            raise OpenAIError(499, "the client closed the connection", type_="server_error", code="cancelled")
        return answer.result()
    finally:
        gone.cancel()
        if not answer.done():  # this task itself was cancelled (the server shutting down)
            call.cancel()
            answer.cancel()
