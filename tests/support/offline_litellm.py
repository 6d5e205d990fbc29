"""litellm imported so that it never reaches past this machine: tests point it at the door on
loopback, and nothing else may be contacted (CI has no network, and a fetch would wait on a timeout).

Imported lazily (not at collection), because importing litellm takes seconds and every xdist worker
collects every test module."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

# Read by litellm at import: the bundled model cost map instead of fetching GitHub's copy; offline mode
# makes every catalog, check or tokenizer it would fetch on its own use its bundled copy or skip.
OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def import_offline() -> ModuleType:
    os.environ.update(OFFLINE_ENV)
    import litellm  # its telemetry is the proxy's, opt-in; the library sends none

    return litellm


@contextmanager
def resolved_hosts() -> Iterator[set[str]]:
    """Every host name looked up inside the block (the sync and asyncio paths both call
    socket.getaddrinfo), so a test can assert that litellm spoke only to loopback."""
    seen: set[str] = set()
    real = socket.getaddrinfo

    def recording(host, *args, **kwargs):
        seen.add(host.decode() if isinstance(host, bytes) else str(host))
        return real(host, *args, **kwargs)

    socket.getaddrinfo = recording
    try:
        yield seen
    finally:
        socket.getaddrinfo = real
