"""The door's own Prometheus metrics, served at its `GET /metrics`: requests by route, method and
HTTP status, and their latency (until the last byte, so a stream counts whole). The route is the
matched route's pattern (`/v1/models/{model_id:path}`), never the raw path, so a caller cannot grow
the label set; paths no route matches count as `unmatched`."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

# Seconds: from a quick 4xx to a long stream.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class DoorMetrics:
    """ASGI middleware that counts every HTTP request, and the registry it counts into."""

    def __init__(self, app):
        self.app = app
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraplex_door_requests_total",
            "HTTP requests answered by the door, by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "loraplex_door_request_duration_seconds",
            "Seconds from a request's arrival to its response's last byte, by route and method",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500  # an exception before any response

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            self.requests.labels(route, method, str(status)).inc()
            self.latency.labels(route, method).observe(time.monotonic() - start)
