"""Python clients of loraplex: `Client` (sync), `AsyncClient` (asyncio), typed errors, the CLI."""

from loraplex.clients.aio import AsyncClient
from loraplex.clients.client import Client
from loraplex.clients.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LoraplexError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "LoraplexError",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
    "Unimplemented",
]
