"""Structured outputs at the door: OpenAI's `response_format` and vLLM's guided-decoding extensions
-> the `constraint` of SamplingParams.

Accepted spellings (at most one per request):
- `response_format`: `{"type": "text"}` (free), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`
  (chat; `strict` true or false decodes the same way: the output always matches the schema, and
  properties the schema does not list are never generated);
- vLLM's `guided_json` (a schema, object or JSON text), `guided_regex`, `guided_choice`,
  `guided_grammar` (EBNF), and `structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}`
  (also `{"json_object": true}`), on completions and chat; its `disable_any_whitespace: false`
  allows any whitespace in JSON (the default is the compact form), `whitespace_pattern` is refused.

A regex matches the whole output. The server compiles the constraint; its INVALID_ARGUMENT names
`sampling_params.KIND`, which `rename_error` turns back into the field the caller wrote.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.services.openai.errors import OpenAIError, bad_request
from loraplex.v1 import inference_pb2 as pb

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
WHITESPACE_KEYS = ("disable_any_whitespace", "whitespace_pattern")


def _schema_text(value: Any, field: str) -> str:
    """A schema given as an object, or as JSON text of one (read here: text that is JSON but no
    schema, such as "1e999", would otherwise reach the grammar compiler, whose refusal says nothing)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise bad_request(f"{field} is JSON nested too deeply", field) from None
        except ValueError as exc:
            raise bad_request(f"{field} is not valid JSON: {exc}", field) from None
        if not isinstance(parsed, dict):
            raise bad_request(f"{field} must be a JSON schema (an object); got JSON {_kind(parsed)}", field)
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    raise bad_request(f"{field} must be a JSON schema (an object); got {_kind(value)}", field)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "an array", type(None): "null"}.get(type(value), type(value).__name__)


def _set(params: pb.SamplingParams, kind: str, value: Any, field: str) -> str:
    """Put one constraint on `params`; returns the gRPC field it became."""
    if kind == "json":
        params.json_schema = _schema_text(value, field)
        return "sampling_params.json_schema"
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{field} must be true", field)
        params.json_object = True
        return "sampling_params.json_object"
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{field} must be a list of strings", field)
        params.choice.choices.extend(value)
        return "sampling_params.choice"
    if not isinstance(value, str):
        raise bad_request(f"{field} must be a string", field)
    setattr(params, kind, value)
    return f"sampling_params.{kind}"


def _known(obj: dict, names: tuple[str, ...], where: str) -> None:
    """A nested unknown key is refused like a top-level one."""
    for key in obj:
        if key not in names:
            raise bad_request(
                f"unknown field {where}.{key[:100]} (known: {', '.join(names)})", f"{where}.{key[:100]}"
            )


def _from_response_format(rf: Any) -> tuple[str, Any, str] | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format must be an object", "response_format")
    _known(rf, ("type", "json_schema"), "response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ("json_object", True, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format.json_schema must be an object with a `schema`", "response_format.json_schema"
            )
        _known(spec, ("name", "description", "schema", "strict"), "response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
            )
        return ("json", spec["schema"], "response_format.json_schema.schema")
    raise bad_request(
        f"response_format.type must be text, json_object or json_schema (got {kind!r})",
        "response_format.type",
    )


def apply(req, params: pb.SamplingParams, response_format: Any = None) -> dict[str, str]:
    """Set `params`' constraint from the request; returns {gRPC field: the caller's field} for
    `rename_error`. Two constraints in one request are a 400."""
    found: list[tuple[str, Any, str]] = []
    if response_format is not None:
        picked = _from_response_format(response_format)
        if picked is not None:
            found.append(picked)
    for name, kind in GUIDED.items():
        if getattr(req, name, None) is not None:
            found.append((kind, getattr(req, name), name))
    so = getattr(req, "structured_outputs", None)
    any_whitespace = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(so) - set(STRUCTURED_KEYS) - set(WHITESPACE_KEYS))
        if unknown:
            raise bad_request(
                f"structured_outputs.{unknown[0]} is not supported (one of "
                f"{', '.join(STRUCTURED_KEYS + WHITESPACE_KEYS)})",
                f"structured_outputs.{unknown[0]}",
            )
        found += [(k, so[k], f"structured_outputs.{k}") for k in STRUCTURED_KEYS if so.get(k) is not None]
        any_whitespace = _any_whitespace(so)
    if not found:
        return {}
    if len(found) > 1:
        raise bad_request(f"give one output constraint; got {', '.join(f for _, _, f in found)}", found[1][2])
    kind, value, field = found[0]
    if any_whitespace:
        if kind not in ("json", "json_object"):
            raise bad_request(
                "structured_outputs.disable_any_whitespace applies to JSON outputs only",
                "structured_outputs.disable_any_whitespace",
            )
        params.json_any_whitespace = True
    return {_set(params, kind, value, field): field}


def _any_whitespace(so: dict) -> bool:
    """vLLM's whitespace controls: `disable_any_whitespace` false allows any whitespace between JSON
    tokens; true (and unset) keeps this server's compact form. xgrammar has no whitespace pattern."""
    if so.get("whitespace_pattern") is not None:
        raise bad_request(
            "structured_outputs.whitespace_pattern is not available: xgrammar has no whitespace "
            "pattern (disable_any_whitespace false allows any whitespace, true the compact form)",
            "structured_outputs.whitespace_pattern",
        )
    value = so.get("disable_any_whitespace")
    if value is not None and not isinstance(value, bool):
        raise bad_request(
            "structured_outputs.disable_any_whitespace must be a boolean",
            "structured_outputs.disable_any_whitespace",
        )
    return value is False


def rename_error(err: OpenAIError, fields: dict[str, str]) -> OpenAIError:
    """The server names `sampling_params.json_schema` (etc.); say the field the caller wrote."""
    for grpc_field, door_field in fields.items():
        # from_grpc may already have shortened `sampling_params.regex` to `regex`
        short = grpc_field.removeprefix("sampling_params.")
        if err.param in (grpc_field, short) or (err.param is None and grpc_field in err.message):
            err.param = door_field
            err.message = err.message.replace(grpc_field, door_field)
            if err.message.startswith(short + " "):
                err.message = door_field + err.message[len(short) :]
    return err
