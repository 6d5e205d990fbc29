"""Chat messages -> prompt token ids with the model's chat template (or an adapter's own).

Rendered as transformers' `apply_chat_template(messages, add_generation_prompt=...,
tokenize=True)` does: the template's text, tokenized without adding special tokens (the
template writes them). An adapter that ships a template uses it (read with its weights at load
time: lora/adapter_files.py), rendered in a worker process with a time and size budget
(template_sandbox.py); the model's own is rendered here. Neither holds the tokenizer lock.
OpenAI tool definitions go to a template that renders `tools`, else are described in the system
message (engine/chat_tools.py).
"""

from __future__ import annotations

from loraplex.services.inference.engine.chat_tools import (
    calls_as_content,
    describe_tools,
    template_knows_tools,
)
from loraplex.services.inference.engine.template_sandbox import TemplateRenderer
from loraplex.services.inference.errors import InvalidRequest

# A rendered prompt longer than this many characters per context token cannot fit (the same
# bound the servicer puts on text before tokenizing it).
MAX_RENDERED_CHARS_PER_TOKEN = 64


# Names a request's chat_template_kwargs may not set: what the renderer itself passes.
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "documents", "tokenize"}
)


def check_template_kwargs(kwargs: dict, reserved: frozenset[str] = frozenset()) -> None:
    """A request's extra template variables may add names, never replace the renderer's own."""
    for name in kwargs:
        if name in RESERVED_TEMPLATE_NAMES or name in reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {name!r} (the server sets it)",
                field="chat_template_kwargs",
            )


def continue_final(text: str, messages: list[dict]) -> str:
    """`text` (rendered without a generation prompt) cut right after the final message's content,
    so the output continues that message (transformers' continue_final_message)."""
    content = (messages[-1].get("content") or "").strip() if messages else ""
    at = text.rfind(content) if content else -1
    if at < 0:
        raise InvalidRequest(
            "continue_final_message: the chat template does not write the final message's content "
            "as it was given, so it cannot be continued",
            field="messages",
        )
    return text[: at + len(content)]


def _with_tools(template: str | None, messages: list[dict], tools: list[dict] | None):
    """(messages, tools) as `template` can take them: a template that does not render tools gets
    them (and earlier calls) written into the messages instead."""
    if not template_knows_tools(template):
        if tools:
            return describe_tools(messages, tools), None
        if any(m.get("tool_calls") for m in messages):
            return calls_as_content(messages), None
    return messages, tools or None


def render_model_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The text of `messages` in the model's own template (the operator's: rendered in-process)."""
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        raise InvalidRequest(
            "this model has no chat template; send text or token ids instead", field="messages"
        )
    messages, tools = _with_tools(source if isinstance(source, str) else None, messages, tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (e.g. roles it refuses)
        raise InvalidRequest(f"the chat template refused these messages: {exc}", field="messages") from None


def render_adapter_template(
    renderer: TemplateRenderer,
    template: str,
    adapter: str,
    messages: list[dict],
    add_generation_prompt: bool,
    variables: dict,
    context_length: int,
    tools: list[dict] | None = None,
) -> str:
    """The text of `messages` in an adapter's own template (its author's code: in a worker)."""
    messages, tools = _with_tools(template, messages, tools)
    return renderer.render(
        template,
        messages,
        add_generation_prompt,
        {**variables, "tools": tools} if tools else variables,
        max_chars=max(1, context_length) * MAX_RENDERED_CHARS_PER_TOKEN,
        what=f"the chat template of adapter {adapter!r}",
    )
