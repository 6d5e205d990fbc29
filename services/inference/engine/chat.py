"""Chat messages -> prompt token ids with the model's chat template (or an adapter's own).

Rendered as transformers' `apply_chat_template(messages, add_generation_prompt=...,
tokenize=True)` does: the template's text, tokenized without adding special tokens (the
template writes them). An adapter that ships a template uses it (read with its weights at load
time: lora/adapter.py).
"""

from __future__ import annotations

import logging

from services.inference.errors import InvalidRequest

log = logging.getLogger(__name__)


def render_chat(
    tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool, template: str | None = None
) -> list[int]:
    """Token ids of `messages` rendered with `template` (default: the tokenizer's own)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model has no chat template; send text or token ids instead", field="messages"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=template
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (e.g. roles it refuses)
        raise InvalidRequest(f"the chat template refused these messages: {exc}", field="messages") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)
