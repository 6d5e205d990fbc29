"""`python -m loraplex.services.openai --target HOST:PORT --port PORT`: the OpenAI-compatible door."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys

import uvicorn

from loraplex.services.openai.app import Backend, create_app

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
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    app = create_app(Backend(args.target, args.served_model_name, args.timeout, args.tls_ca))
    # The asyncio loop: grpc.aio runs on it (uvloop is not a loop grpc.aio supports).
    config = uvicorn.Config(
        app, log_level=args.log_level.lower(), access_log=False, lifespan="on", loop="asyncio", http=args.http
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
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
