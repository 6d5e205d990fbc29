"""What one HTTP client may hold of the door: body size, time to send headers and body, connections.

- `BodyLimit` (ASGI middleware): a body over `max_body_bytes` gets 413 before it is read (from its
  Content-Length, or counted as a chunked body arrives); a body that stalls longer than
  `body_timeout_s` between two reads gets 408.
- `header_timeout_protocol`: uvicorn's HTTP protocol, plus a timer from the connection's start (and
  from the end of each response) to the next request's complete headers; a connection that sends
  nothing, or headers a byte at a time, is closed when it fires. uvicorn's own keep-alive timeout
  only starts after a response, and its concurrency limit counts such idle connections too.
- `AcceptErrorFilter`: asyncio logs every failed accept() (descriptors used up) once per loop turn;
  this lets one through per interval with the count of those dropped.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from loraplex.services.openai.errors import OpenAIError


class BodyLimit:
    def __init__(self, app, max_body_bytes: int, body_timeout_s: float | None):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s

    def _too_large(self, size: int | None = None) -> OpenAIError:
        got = f" ({size} bytes)" if size is not None else ""
        return OpenAIError(
            413,
            f"the request body is over {self.max_body_bytes} bytes{got}, the door's --max-body-bytes",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size < 0:
                await OpenAIError(400, "Content-Length is not a byte count").response()(scope, receive, send)
                return
            if size > self.max_body_bytes:
                await self._too_large(size).response()(scope, receive, send)
                return
        received = 0
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # after the body: only http.disconnect is left to wait for, for as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                raise OpenAIError(
                    408,
                    f"the request body stalled for {self.body_timeout_s:g} s (--body-timeout)",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)


def header_timeout_protocol(base: type, header_timeout_s: float) -> type:
    """`base` (uvicorn's H11Protocol or HttpToolsProtocol) closing a connection whose next request's
    headers are not complete `header_timeout_s` after it opened or after the previous response."""

    class HeaderTimeoutProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer(None)

        def on_response_complete(self) -> None:
            finished = self.cycle  # before super(), which may start a pipelined request's cycle
            super().on_response_complete()
            self._arm_header_timer(finished)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self, waiting_after) -> None:
            # A new request replaces `self.cycle` once its headers are in; until then it is still
            # `waiting_after` (None on a new connection, else the last answered request's).
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout, waiting_after)

        def _header_timeout(self, waiting_after) -> None:
            self._header_timer = None
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


class AcceptErrorFilter(logging.Filter):
    """Let one failed-accept record through per `interval_s`, noting how many were dropped."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._last: float | None = None
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "accept" not in record.getMessage().lower():
            return True
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._dropped += 1
            return False
        if self._dropped:
            record.msg = (
                f"{record.getMessage()} ({self._dropped} more like it in the last {self.interval_s:g} s)"
            )
            record.args = ()
        self._last, self._dropped = now, 0
        return True


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft descriptor limit to the hard one (each connection holds one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard
