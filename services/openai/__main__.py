"""`python -m loraplex.services.openai --target HOST:PORT --port PORT`: the OpenAI-compatible door."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from loraplex.services.openai.app import create_app
from loraplex.services.openai.backend import DEFAULT_MAX_BODY_BYTES, Backend
from loraplex.services.openai.limits import (
    AcceptErrorFilter,
    BodyLimit,
    header_timeout_protocol,
    raise_open_file_limit,
)

log = logging.getLogger("loraplex.services.openai")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraplex.services.openai", description=__doc__)
    p.add_argument("--target", default="127.0.0.1:50051", help="the inference server (or router), HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (logged)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the base model's name in `model` (default: the last part of the server's model path)",
    )
    p.add_argument("--tls-ca", default=None, help="PEM to verify a TLS --target with (plaintext without it)")
    p.add_argument(
        "--timeout", type=float, default=None, help="gRPC deadline per call, seconds (default none)"
    )
    p.add_argument(
        "--http",
        default="auto",
        choices=["auto", "h11", "httptools"],
        help="uvicorn's HTTP parser (auto: httptools when installed)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 before they are read (default 64 MiB, the inference "
        "server's default --max-message-bytes: set both together)",
    )
    p.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds a connection has to send a request's headers, from its start or the last response",
    )
    p.add_argument(
        "--body-timeout", type=_positive(float), default=30.0, help="seconds a request body may stall (408)"
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=_positive(float),
        default=5.0,
        help="seconds an idle keep-alive connection stays",
    )
    p.add_argument(
        "--max-concurrency",
        type=_positive(int),
        default=1024,
        help="open connections and running requests at most; beyond, 503 (the descriptor limit is raised "
        "to its hard limit at start)",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return value

    parse.__name__ = kind.__name__
    return parse


async def serve(args: argparse.Namespace) -> None:
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    backend = Backend(args.target, args.served_model_name, args.timeout, args.tls_ca, args.max_body_bytes)
    # vLLM's adapter routes answer only with this token (the environment keeps it out of `ps`)
    admin_token = os.environ.get("LORAPLEX_ADMIN_TOKEN") or None
    app = BodyLimit(create_app(backend, admin_token), args.max_body_bytes, args.body_timeout)
    protocol = header_timeout_protocol(import_from_string(HTTP_PROTOCOLS[args.http]), args.header_timeout)
    soft, _ = raise_open_file_limit()
    if soft < args.max_concurrency + 64:
        log.warning("only %d file descriptors for --max-concurrency %d", soft, args.max_concurrency)
    # The asyncio loop: grpc.aio runs on it (uvloop is not a loop grpc.aio supports).
    config = uvicorn.Config(
        app,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="on",
        loop="asyncio",
        http=protocol,
        ws="none",
        timeout_keep_alive=args.keep_alive_timeout,
        limit_concurrency=args.max_concurrency,
    )
    server = _Server(config)
    host, port = sock.getsockname()[:2]
    # the line clients/processes.py (and `loraplex up`) read the port from
    log.info("OpenAI-compatible API over %s listening on %s:%d", args.target, host, port)
    await server.serve(sockets=[sock])


class _Server(uvicorn.Server):
    """Stops on SIGTERM / SIGINT after finishing open requests, then exits 0 like the gRPC servers
    (uvicorn's own handler re-raises the signal after its graceful shutdown, so the status reads "killed")."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # asyncio logs each failed accept() (descriptors used up) on every loop turn: once per 10 s here.
    logging.getLogger("asyncio").addFilter(AcceptErrorFilter(10.0))
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
