"""Python clients of loraplex: `Client` (sync), `AsyncClient` (asyncio), typed errors, the CLI."""

from clients.aio import AsyncClient
from clients.client import Client
from clients.errors import (
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
