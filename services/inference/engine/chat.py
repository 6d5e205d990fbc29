"""Chat messages -> prompt token ids with the model's chat template (or an adapter's own).

Rendered as transformers' `apply_chat_template(messages, add_generation_prompt=...,
tokenize=True)` does: the template's text, tokenized without adding special tokens (the
template writes them). An adapter that ships a template (`chat_template.jinja`, or
`chat_template` in its `tokenizer_config.json`, as `save_pretrained` writes them) uses it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loraplex.services.inference.engine.chat_tools import (
    calls_as_content,
    describe_tools,
    template_knows_tools,
)
from loraplex.services.inference.errors import InvalidRequest

log = logging.getLogger(__name__)


def adapter_chat_template(adapter_dir: str | Path) -> str | None:
    """The chat template an adapter directory ships, or None."""
    root = Path(adapter_dir)
    jinja = root / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text()
        config = root / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            return template if isinstance(template, str) and template else None
    except (OSError, ValueError) as exc:
        log.warning("adapter %s: cannot read its chat template: %s", root, exc)
    return None


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    template: str | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered with `template` (default: the tokenizer's own); `tools`:
    OpenAI tool definitions (engine/chat_tools.py: passed to a template that renders them, else
    described in the system message)."""
    source = template or getattr(tokenizer, "chat_template", None)
    if not source:
        raise InvalidRequest(
            "this model has no chat template; send text or token ids instead", field="messages"
        )
    if not template_knows_tools(source if isinstance(source, str) else None):
        if tools:
            messages, tools = describe_tools(messages, tools), None
        elif any(m.get("tool_calls") for m in messages):
            messages = calls_as_content(messages)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=template,
            tools=tools or None,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (e.g. roles it refuses)
        raise InvalidRequest(f"the chat template refused these messages: {exc}", field="messages") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)
