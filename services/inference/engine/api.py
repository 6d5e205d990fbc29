"""`Engine`: the one interface the servicer, the adapter resolver and the server use.

`AsyncEngine` (one device) and `TPAsyncEngine` (tensor parallel) implement it. It knows nothing of
gRPC: failures are `loraplex.services.inference.errors` exceptions, which the servicer maps to status codes.

Methods that wait (for the model, the disk or other threads) are coroutines and must be awaited on
the caller's event loop; the others return at once and are called directly, from the event loop.
`generate` is plain: it checks the request at once and returns the stream, whose iteration waits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Protocol

from loraplex.services.inference.engine.types import EngineStats, ModelInfo, RequestOutput, SamplingParams
from loraplex.services.inference.lora.adapter_slots import AdapterInfo


class Engine(Protocol):
    # -- requests ---------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        adapter: str | None,
        params: SamplingParams,
        draft_adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Check one request and return its output stream (the last output has finished=True).

        The check is the only validation of a prompt and its sampling parameters against this
        model, done in this call, before anything is queued: it raises `InvalidRequest` (empty
        prompt, ids outside the vocabulary, no room for a new token in the context, a sampling
        value out of range; `field` is "text" or "sampling_params.NAME"), `CapacityExceeded`
        (the prompt outgrows the whole KV cache) or `BackendUnavailable` (the engine is shut down
        or unhealthy), and for a `draft_adapter` (the draft model's adapter) `InvalidRequest` (no
        draft adapters are served) or `AdapterNotFound` (not one of them). The request is queued
        when the stream is first iterated, which may raise
        `AdapterNotFound` (`adapter` is not loaded), `InvalidRequest` (the id is already in
        flight), `CapacityExceeded` (the queue is full) or `BackendUnavailable` (a step failed).
        Closing the stream early aborts the request.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks and adapter reference; its stream ends with
        finish_reason "abort". Unknown ids are ignored. Returns at once (the engine thread acts)."""
        ...

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        """The prompt ids of `text` (no special tokens beyond what the tokenizer adds itself; none
        at all with `add_special_tokens` False), by `adapter`'s tokenizer (`tokenizer_for`)."""
        ...

    def tokenizer_for(self, adapter: str | None = None) -> AbstractContextManager:
        """The tokenizer of `adapter`'s requests, held for the caller's thread while the context
        lasts: the adapter's own when it ships one (engine/adapter_tokenizers.py), else the base
        model's. Every method here that turns text into ids or back goes through it."""
        ...

    def render_chat(
        self,
        messages: list[dict],
        adapter: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids of chat `messages`: the adapter's own chat template when its directory ships
        one, else the model's; `tools` (OpenAI tool definitions) as engine/chat_tools.py renders them;
        `template_kwargs` extra template variables (never the renderer's own names);
        `continue_final_message` leaves the last message open (needs add_generation_prompt False).
        The ids are the adapter's tokenizer's (`tokenizer_for`).
        Raises `InvalidRequest` when the template cannot render them."""
        ...

    def detokenize_each(self, token_ids: list[int], adapter: str | None = None) -> list[str]:
        """Each token's text alone (the `token` of log probabilities)."""
        ...

    def token_bytes(self, token_ids: list[int], adapter: str | None = None) -> list[bytes]:
        """Each token's raw bytes (engine/token_bytes.py): part of a character stays its bytes."""
        ...

    # -- adapters ---------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str, pin: bool = False) -> AdapterInfo:
        """Read, check and register the adapter at local `path` (replacing a same-named one once
        its running requests finish). Raises `AdapterInvalid`, `AdapterIncompatible`,
        `CapacityExceeded` (pin) or `AdapterNotFound` (a server without LoRA)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """New requests for `name` fail at once; running ones finish. `AdapterNotFound` if absent."""
        ...

    def has_adapter(self, name: str) -> bool: ...

    def list_adapters(self) -> list[AdapterInfo]:
        """The adapters loaded here (empty on a server without LoRA)."""
        ...

    # -- state ------------------------------------------------------------------------------

    def model_info(self) -> ModelInfo: ...

    def stats(self) -> EngineStats:
        """A snapshot of queue, KV cache and LoRA slot counts (read by metrics and admission)."""
        ...

    def healthy(self) -> bool:
        """False once the engine (or a tensor-parallel worker) has died: report NOT_SERVING."""
        ...

    def unhealthy_reason(self) -> str | None: ...

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (and its workers); requests still running end with `BackendUnavailable`."""
        ...
