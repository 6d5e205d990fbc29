"""The OpenAI-compatible door as a real process for tests: started on a free port in front of a gRPC
server, ready once its /health answers, stopped afterwards."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from loraplex.clients.processes import ServerProcess


@contextmanager
def running_door(
    target: str, name: str = "openai", env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """`python -m loraplex.services.openai --target TARGET --port 0`, yielded once it serves /health."""
    kw = {"env": env} if env else {}
    proc = ServerProcess(
        name, "loraplex.services.openai", ["--target", target, "--port", "0"], echo=False, **kw
    )
    try:
        proc.wait_bound(60)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{proc.address}/health", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.proc.poll() is not None:
                    raise RuntimeError(proc.output()) from None
                time.sleep(0.1)
        yield proc
    finally:
        proc.stop()
