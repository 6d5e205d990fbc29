"""Text <-> ids for the callers of AsyncEngine, on their own threads, never the engine thread's.

Each request's text goes through one tokenizer: its adapter's own when the adapter ships one
(engine/adapter_tokenizers.py), else the base model's. A fast tokenizer must not be used from two
threads at once, so callers get copies of their own (the base's one, each adapter's `caller`), each
held under its lock while in use; the engine thread decodes outputs with its own copies. Chat
templates render outside those locks: the model's in place, an adapter's in a killable worker
process (engine/template_sandbox.py).
"""

from __future__ import annotations

import contextlib
import threading

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
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.lora.adapter_files import read_side_file
from loraplex.services.inference.lora.manager import LoRAManager


class CallerTokenizers:
    """The base model's caller-side tokenizer and the adapters' own (`adapters`), and what goes
    through them: the `Engine` methods tokenizer_for, tokenize, render_chat, detokenize_each and
    token_bytes (engine/api.py). `lora_manager` gives adapters' chat templates (None: no LoRA)."""

    def __init__(self, engine: LLMEngine, lora_manager: LoRAManager | None):
        self.lora_manager = lora_manager
        self.context_length = engine.context_length
        self._tokenizer = _clone_tokenizer(engine)
        self._lock = threading.Lock()
        # What transformers hands a template besides the messages (bos_token, eos_token, ...).
        self._template_variables = dict(self._tokenizer.special_tokens_map)
        self._templates = TemplateRenderer()  # adapters' templates: worker processes, started on first use
        self._token_bytes = TokenBytes(self._tokenizer)
        # Adapters that ship a tokenizer of their own.
        self.adapters = AdapterTokenizers(
            engine.loaded.model_dir,
            engine.loaded.config.vocab_size,
            self._tokenizer,
            on_drop=engine.grammars.forget_tokenizer,  # its compiled grammars go with it
        )

    def prepare(self, name: str, path: str):
        """The tokenizer the adapter directory's files make (None: the base's), read once, now, and
        checked to fit; `adapters.assign` gives it to `name` once the adapter is loaded."""
        own = self.adapters.prepare(read_tokenizer_files(path, read_side_file))
        self.adapters.check_room(name, own)
        return own

    def close(self) -> None:
        self._templates.close()  # a render under way ends now, not when its template would

    @contextlib.contextmanager
    def tokenizer_for(self, adapter: str | None = None):
        """The tokenizer of `adapter`'s requests, held for the caller's thread: its own when it
        ships one, else the base model's."""
        own = self.adapters.get(adapter)
        if own is None:
            with self._lock:
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
        own = self.adapters.get(adapter)
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
                self.context_length,
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
        own = self.adapters.get(adapter)
        table = own.token_bytes if own is not None else self._token_bytes
        with self.tokenizer_for(adapter):
            return [table(t) for t in token_ids]


def _clone_tokenizer(engine: LLMEngine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.loaded.model_dir)
