"""AsyncEngine: the `Engine` (engine/api.py) over one LLMEngine. The model runs on one engine thread.

Requests and aborts are handed to the engine thread through a thread-safe inbox; outputs
come back to each caller's event loop with `loop.call_soon_threadsafe` into a per-request
asyncio.Queue, so no coroutine ever waits on the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from loraplex.services.inference.engine.adapter_tokenizers import AdapterTokenizers, read_tokenizer_files
from loraplex.services.inference.engine.chat import (
    check_template_kwargs,
    continue_final,
    render_adapter_template,
    render_model_template,
)
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.template_sandbox import TemplateRenderer
from loraplex.services.inference.engine.token_bytes import TokenBytes
from loraplex.services.inference.engine.types import EngineStats, ModelInfo, RequestOutput, SamplingParams
from loraplex.services.inference.errors import (
    AdapterNotFound,
    BackendUnavailable,
    InvalidRequest,
    LoraplexError,
)
from loraplex.services.inference.lora.adapter_files import read_side_file
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
        # The engine thread uses engine.tokenizer for decoding; callers get their own copy
        # because a fast tokenizer must not be used from two threads at once.
        self._tokenizer = _clone_tokenizer(engine)
        self._tokenizer_lock = threading.Lock()
        # What transformers hands a template besides the messages (bos_token, eos_token, ...).
        self._template_variables = dict(self._tokenizer.special_tokens_map)
        self._templates = TemplateRenderer()  # adapters' templates: worker processes, started on first use
        self._token_bytes = TokenBytes(self._tokenizer)
        # Adapters that ship a tokenizer of their own (engine/adapter_tokenizers.py).
        self.adapter_tokenizers = AdapterTokenizers(
            engine.loaded.model_dir,
            engine.loaded.config.vocab_size,
            self._tokenizer,
            on_drop=engine.grammars.forget_tokenizer,  # its compiled grammars go with it
        )
        for info in lora_manager.list_adapters() if lora_manager is not None else ():
            self._adopt_tokenizer(info.name, info.source)  # loaded at start (--lora-paths)
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
        own = self.adapter_tokenizers.get(adapter)
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

    @contextlib.contextmanager
    def tokenizer_for(self, adapter: str | None = None):
        """The tokenizer of `adapter`'s requests, held for the caller's thread: its own when it
        ships one (engine/adapter_tokenizers.py), else the base model's. Every text <-> ids of a
        request goes through here (the engine thread decodes with its own copies)."""
        own = self.adapter_tokenizers.get(adapter)
        if own is None:
            with self._tokenizer_lock:
                yield self._tokenizer
        else:
            with own.lock:
                yield own.caller

    def tokenize(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        with self.tokenizer_for(adapter) as tokenizer:
            return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(
        self,
        messages: list[dict],
        adapter: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids of chat `messages` (engine/chat.py); an adapter's own template when it ships one."""
        kwargs = dict(template_kwargs or {})
        own = self.adapter_tokenizers.get(adapter)
        variables = own.template_variables if own is not None else self._template_variables
        check_template_kwargs(kwargs, frozenset(variables))
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt false", field="continue_final_message"
            )
        # Read with the adapter's weights at load time (lora/adapter_files.py), never from its directory now.
        template = self.lora_manager.chat_template(adapter) if adapter and self.lora_manager else None
        # Rendered outside the tokenizer lock: a slow template must not hold every other request.
        if template is None:
            model_tokenizer = own.caller if own is not None else self._tokenizer
            text = render_model_template(model_tokenizer, messages, add_generation_prompt, tools, kwargs)
        else:
            text = render_adapter_template(
                self._templates,
                template,
                adapter or "",
                messages,
                add_generation_prompt,
                {**variables, **kwargs},
                self.engine.context_length,
                tools,
            )
        if continue_final_message:
            text = continue_final(text, messages)
        return self.tokenize(text, add_special_tokens=False, adapter=adapter)

    def detokenize_each(self, token_ids: list[int], adapter: str | None = None) -> list[str]:
        """Each token's text alone (for log probabilities' `token`)."""
        with self.tokenizer_for(adapter) as tokenizer:
            return [tokenizer.decode([t]) for t in token_ids]

    def token_bytes(self, token_ids: list[int], adapter: str | None = None) -> list[bytes]:
        own = self.adapter_tokenizers.get(adapter)
        table = own.token_bytes if own is not None else self._token_bytes
        with self.tokenizer_for(adapter):
            return [table(t) for t in token_ids]

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
        own = self._tokenizer_of(name, path)
        info = self._manager().load_adapter(name, path, pin)
        self.adapter_tokenizers.assign(name, own)
        return info

    def _adopt_tokenizer(self, name: str, path: str) -> None:
        self.adapter_tokenizers.assign(name, self._tokenizer_of(name, path))

    def _tokenizer_of(self, name: str, path: str):
        """The tokenizer the adapter directory's files make (None: the base's), read once, now."""
        own = self.adapter_tokenizers.prepare(read_tokenizer_files(path, read_side_file))
        self.adapter_tokenizers.check_room(name, own)
        return own

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self._manager().unload_adapter, name)
        self.adapter_tokenizers.forget(name)
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
        self._templates.close()  # a render under way ends now, not when its template would
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


def _clone_tokenizer(engine: LLMEngine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.loaded.model_dir)
