"""Engine-level errors. They know nothing of gRPC; the servicer maps each to a status code.

| error                 | gRPC status          |
| --------------------- | -------------------- |
| InvalidRequest        | INVALID_ARGUMENT     |
| AdapterInvalid        | INVALID_ARGUMENT     |
| AdapterNotFound       | NOT_FOUND            |
| AdapterIncompatible   | FAILED_PRECONDITION  |
| CapacityExceeded      | RESOURCE_EXHAUSTED   |
| BackendUnavailable    | UNAVAILABLE          |
| NonFiniteLogits       | INTERNAL             |
"""

from __future__ import annotations


class LoraplexError(Exception):
    """Base class; `field` names the request field or adapter file at fault, when known."""

    def __init__(self, message: str, *, field: str | None = None, adapter: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.adapter = adapter


class InvalidRequest(LoraplexError):
    """The request itself is malformed (bad sampling value, prompt too long, ...)."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt leaves no room for a new token in the model's context. Carried to clients as an
    ErrorInfo (reason CONTEXT_LENGTH_EXCEEDED, the two counts) so the HTTP door can say it the way
    OpenAI does. `prompt_tokens` 0: not counted (a text refused by its length before tokenizing)."""

    reason = "CONTEXT_LENGTH_EXCEEDED"

    def __init__(self, message: str, *, prompt_tokens: int, context_length: int, field: str | None = None):
        super().__init__(message, field=field)
        self.prompt_tokens, self.context_length = prompt_tokens, context_length


class AdapterInvalid(LoraplexError):
    """The adapter files are malformed: no server configuration could run them."""


class AdapterNotFound(LoraplexError):
    """No adapter of that name is loaded here (and none could be pulled)."""


class AdapterIncompatible(LoraplexError):
    """The adapter is well-formed but does not fit this server (rank, modules, base model)."""


class CapacityExceeded(LoraplexError):
    """A queue, pool or limit is full; retrying later may succeed."""


class BackendUnavailable(LoraplexError):
    """The engine (shut down, still loading, a failed step or TP worker) or the adapter store
    cannot serve the call now; retrying later, or on another replica, may succeed."""


class NonFiniteLogits(LoraplexError):
    """A request's logits turned NaN or Inf (its adapter's or the model's weights overflow): that
    request ends with this error, the rest of its batch goes on. Retrying gives the same."""
