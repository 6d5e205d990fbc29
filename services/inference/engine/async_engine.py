"""AsyncEngine: the `Engine` (engine/api.py) over one LLMEngine. The model runs on one engine thread.

Requests and aborts are handed to the engine thread through a thread-safe inbox; outputs
come back to each caller's event loop with `loop.call_soon_threadsafe` into a per-request
asyncio.Queue, so no coroutine ever waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from loraplex.services.inference.engine.caller_tokenizers import CallerTokenizers
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import EngineStats, ModelInfo, RequestOutput, SamplingParams
from loraplex.services.inference.errors import (
    AdapterNotFound,
    BackendUnavailable,
    InvalidRequest,
    LoraplexError,
)
from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.lora.manager import LoRAManager

log = logging.getLogger(__name__)


class _Add(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    params: SamplingParams
    arrival_time: float
    draft_adapter: str | None = None
    grammar: object = None  # params.constraint compiled (engine/grammar.py), when it has one
    tokenizer: object = None  # the adapter's own, the engine thread's copy (None: the base's)
    own: object = None  # the adapter's AdapterTokenizer entry: its constraint is compiled on it


class _Abort(NamedTuple):
    request_id: str


class _Sink(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-safe, asyncio-facing wrapper around one LLMEngine; implements `Engine`.

    `lora_manager`: the adapters this engine serves (None: a server without LoRA).
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        lora_manager: LoRAManager | None = None,
        model_info: ModelInfo | None = None,
    ):
        self.engine = engine
        self.lora_manager = lora_manager
        self._model_info = model_info or default_model_info(engine)
        # Callers' text <-> ids, on their threads (the engine thread decodes with its own copies).
        self.tokenizers = CallerTokenizers(engine, lora_manager)
        for info in lora_manager.list_adapters() if lora_manager is not None else ():
            # loaded at start (--lora-paths)
            self.tokenizers.adapters.assign(info.name, self.tokenizers.prepare(info.name, info.source))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- requests -------------------------------------------------------------------------

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        adapter: str | None,
        params: SamplingParams,
        draft_adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Check the prompt and params now (`Engine.generate`); the adapter and the queue are
        checked when the stream is first iterated, which queues the request."""
        arrival = time.monotonic()
        if self._stopped.is_set():
            raise BackendUnavailable("the engine is shut down")
        prompt_ids = self.tokenize(prompt, adapter=adapter) if isinstance(prompt, str) else list(prompt)
        self.engine.check_request(prompt_ids, params)
        self.engine.check_draft_adapter(draft_adapter)
        own = self.tokenizers.adapters.get(adapter)
        add = _Add(
            request_id,
            prompt_ids,
            adapter or None,
            params,
            arrival,
            draft_adapter or None,
            tokenizer=own.engine if own is not None else None,
            own=own,
        )
        return self._stream(add)

    async def _stream(self, add: _Add) -> AsyncIterator[RequestOutput]:
        if add.adapter is not None and not self.has_adapter(add.adapter):
            raise AdapterNotFound(
                f"adapter {add.adapter!r} is not loaded on this server", adapter=add.adapter
            )
        if add.params.constraint is not None:
            # Compiled on the grammar cache's threads: the batch runs on while this request waits,
            # against the token strings of the tokenizer its text went through (the adapter's own).
            # The servicer names a call's engine requests `{call id}-{k}`: the call is the owner
            # the compile pool shares its workers fairly between.
            owner = add.request_id.rpartition("-")[0] or add.request_id
            grammar = await self.engine.grammars.compile_async(add.params.constraint, owner, add.own)
            add = add._replace(grammar=grammar)
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._sinks_lock:
            if add.request_id in self._sinks:
                raise InvalidRequest(f"request id {add.request_id!r} is already in flight")
            self._sinks[add.request_id] = sink
        self._send(add)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._sinks_lock:
                self._sinks.pop(add.request_id, None)
            if not finished:
                self._send(_Abort(add.request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks and adapter reference (its stream ends with 'abort')."""
        self._send(_Abort(request_id))

    # -- text <-> ids (engine/caller_tokenizers.py) ------------------------------------------

    def tokenizer_for(self, adapter: str | None = None):
        return self.tokenizers.tokenizer_for(adapter)

    def tokenize(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        return self.tokenizers.tokenize(text, add_special_tokens, adapter)

    def render_chat(
        self,
        messages: list[dict],
        adapter: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        return self.tokenizers.render_chat(
            messages, adapter, add_generation_prompt, tools, template_kwargs, continue_final_message
        )

    def detokenize_each(self, token_ids: list[int], adapter: str | None = None) -> list[str]:
        return self.tokenizers.detokenize_each(token_ids, adapter)

    def token_bytes(self, token_ids: list[int], adapter: str | None = None) -> list[bytes]:
        return self.tokenizers.token_bytes(token_ids, adapter)

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # -- adapters (delegated to the LoRA manager) --------------------------------------------

    def _manager(self) -> LoRAManager:
        if self.lora_manager is None:
            raise AdapterNotFound("this server runs without LoRA support (no LoRA manager configured)")
        return self.lora_manager

    async def load_adapter(self, name: str, path: str, pin: bool = False) -> AdapterInfo:
        return await asyncio.to_thread(self._load_adapter, name, path, pin)

    def _load_adapter(self, name: str, path: str, pin: bool) -> AdapterInfo:
        # Its tokenizer is built and checked first: a refused one leaves the name as it was.
        own = self.tokenizers.prepare(name, path)
        info = self._manager().load_adapter(name, path, pin)
        self.tokenizers.adapters.assign(name, own)
        return info

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self._manager().unload_adapter, name)
        self.tokenizers.adapters.forget(name)
        self.engine.forget_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def has_adapter(self, name: str) -> bool:
        return self.lora_manager is not None and self.lora_manager.has_adapter(name)

    # -- lifecycle ------------------------------------------------------------------------

    def healthy(self) -> bool:
        """False once the engine thread has stopped: the server then reports NOT_SERVING."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def unhealthy_reason(self) -> str | None:
        return None if self.healthy() else "the engine loop has stopped"

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with BackendUnavailable."""
        self._stopped.set()
        self._wake.set()
        self.tokenizers.close()  # a chat template's render under way ends now
        self.engine.grammars.close()  # queued compiles fail now
        await asyncio.to_thread(self._thread.join, timeout)

    # -- engine thread --------------------------------------------------------------------

    def _send(self, command: _Add | _Abort) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._sinks_lock:
            sink = self._sinks.get(request_id)
        if sink is not None and not sink.loop.is_closed():
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_ids,
                        command.params,
                        command.adapter,
                        arrival_time=command.arrival_time,
                        grammar=command.grammar,
                        draft_adapter=command.draft_adapter,
                        tokenizer=command.tokenizer,
                    )
                except LoraplexError as exc:
                    self._deliver(command.request_id, exc)
            else:
                out = self.engine.abort_request(command.request_id)
                if out is not None:
                    self._deliver(out.request_id, out)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # never leave callers hanging on a dead loop
                log.exception("engine step failed; failing the running requests")
                self._fail_all(BackendUnavailable(f"engine step failed: {exc}"))
                continue
            for out in outputs:
                req_error = None
                if out.finished and out.finish_reason == "abort":
                    req_error = self._request_error(out.request_id)
                self._deliver(out.request_id, req_error or out)
        self._fail_all(BackendUnavailable("the engine shut down"))

    def _request_error(self, request_id: str) -> BaseException | None:
        return self.engine.errors.pop(request_id, None)

    def _fail_all(self, exc: LoraplexError) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, exc)


def default_model_info(engine: LLMEngine) -> ModelInfo:
    loaded = engine.loaded
    return ModelInfo(
        model=engine.config.model_path,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=loaded.device.type,
        max_loras_per_batch=0,
        max_lora_rank=0,
        lora_target_modules=[],
        lora_backend="none",
        tp_size=1,
        context_length=engine.context_length,
        architecture=loaded.config.architecture,
        family=loaded.config.family.name,
    )
