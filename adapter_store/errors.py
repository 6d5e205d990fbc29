"""Store errors. They know nothing of gRPC; the servicer maps each to one status code.

| error               | gRPC status          |
| ------------------- | -------------------- |
| InvalidArgument     | INVALID_ARGUMENT     |
| NotFound            | NOT_FOUND            |
| PermissionDenied    | PERMISSION_DENIED    |
| FailedPrecondition  | FAILED_PRECONDITION  |
| ResourceExhausted   | RESOURCE_EXHAUSTED   |
| Unavailable         | UNAVAILABLE          |
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class. `field` names what is at fault: a request field (`name`, `source`) or, for a
    broken adapter, `<file>` / `<file>:<tensor>` / `<file>:<tensor>.<attribute>`."""

    def __init__(self, message: str, *, field: str | None = None, name: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.name = name


class InvalidArgument(StoreError):
    """A malformed request or a broken adapter; retrying the same thing fails again."""


class NotFound(StoreError):
    """No adapter of that name, or the source (repo, revision, path) does not exist."""


class PermissionDenied(StoreError):
    """The source refused the store's credentials (HF_TOKEN) or lies outside --allowed-local-dirs."""


class FailedPrecondition(StoreError):
    """The adapter is well formed but does not fit this store (e.g. --base-model shapes)."""


class ResourceExhausted(StoreError):
    """A size limit of the store is exceeded."""


class Unavailable(StoreError):
    """A dependency (Redis, the Hub) cannot be reached now; retrying later may succeed."""
