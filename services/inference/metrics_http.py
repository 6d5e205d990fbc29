"""The HTTP exporter of `--metrics-port`: `GET /metrics` on a daemon thread, 404 elsewhere."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> int:
    """Start the HTTP exporter of `registry` on a daemon thread; returns the bound port. It answers
    `GET /metrics` only (404 elsewhere: a health check pointed at it must not read 200)."""
    server_class = _IPv6Server if ":" in host else ThreadingWSGIServer
    app = metrics_only(make_wsgi_app(registry))
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        """No access log on stderr (as prometheus_client's own exporter)."""


class _IPv6Server(ThreadingWSGIServer):
    address_family = socket.AF_INET6


def metrics_only(app):
    """A WSGI app that passes `/metrics` to `app` and answers 404 to every other path."""

    def route(environ, start_response):
        if environ.get("PATH_INFO", "") in ("/metrics", "/metrics/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: this port serves GET /metrics only\n"]

    return route
