"""What the door checks before a body's fields are read or a gRPC call is made: the JSON itself,
strings that cannot travel as UTF-8, the bearer token and the `model` name. Each refusal is a 400
naming what to fix; none reaches grpc, whose client-side errors would read as 500 or 429."""

from __future__ import annotations

import json
from typing import Any

from loraplex.services.inference.lora.names import ADAPTER_NAME_RULE, is_adapter_name
from loraplex.services.openai.errors import OpenAIError, bad_request, model_not_found

# gRPC metadata is printable ASCII and the server reads at most 8 KiB of it (grpc's default).
MAX_TOKEN_CHARS = 4096
MAX_MODEL_CHARS = 256


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad_request("the body is JSON nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise bad_request(f"the body is not valid JSON: {exc}") from None


def _param(path: list[str | int]) -> str:
    """OpenAI's spelling of a field path: messages[0].content."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def check_strings(body: Any) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's "\\ud800") anywhere in the body, keys included: it has no
    UTF-8 form, so it cannot become a protobuf string."""
    stack: list[tuple[list[str | int], Any]] = [([], body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _utf8_ok(value):
                where = _param(path) or "the body"
                raise bad_request(
                    f"{where} contains a lone UTF-16 surrogate (not valid Unicode text)", _param(path)
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _utf8_ok(key):
                    raise bad_request(
                        f"a key in {_param(path) or 'the body'} contains a lone UTF-16 surrogate",
                        _param(path),
                    )
                stack.append(([*path, key], item))
        elif isinstance(value, list):
            stack.extend(([*path, i], item) for i, item in enumerate(value))


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_authorization(value: str | None) -> None:
    """The Authorization header travels to the server as gRPC metadata: printable ASCII, bounded."""
    if value is None:
        return
    if not (value.isascii() and value.isprintable()):
        raise OpenAIError(
            400, "the Authorization header must be printable ASCII (Bearer <token>)", code="invalid_api_key"
        )
    if len(value) > MAX_TOKEN_CHARS:
        raise OpenAIError(
            400,
            f"the Authorization header has {len(value)} characters; at most {MAX_TOKEN_CHARS}",
            code="invalid_api_key",
        )


def check_model_text(model: str) -> None:
    """Before the base model's names are known: what no model or adapter name can be."""
    if not model:
        raise bad_request("model must name the base model or an adapter", "model")
    if len(model) > MAX_MODEL_CHARS or not (model.isascii() and model.isprintable()):
        raise bad_request(
            f"model must be the base model's name or an adapter name ({ADAPTER_NAME_RULE})", "model"
        )


def check_adapter_model(model: str) -> None:
    """A `model` that is not the base model names an adapter: one the adapter-name rule refuses
    cannot exist, so it is model_not_found without asking the server."""
    if not is_adapter_name(model):
        raise model_not_found(model)
