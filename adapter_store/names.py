"""Adapter names: what the index keys, file names and events may contain."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from loraplex.adapter_store.errors import InvalidArgument

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Return `name` if it is a valid adapter name, else raise InvalidArgument."""
    if not NAME_RE.fullmatch(name or ""):
        # Not echoed whole: a 5000-character name would overflow the status trailer (16 KiB).
        raise InvalidArgument(
            f"adapter name {name[:160]!r}{'...' if len(name or '') > 160 else ''} is invalid: use 1-128 "
            "characters from [A-Za-z0-9._-], starting with a letter or digit",
            field="name",
        )
    return name


def check_not_base_model(name: str, base_model: str | None) -> None:
    """Refuse a name that is the base model's (its path or Hub id, or the last part of either,
    case-insensitively): inference servers and the HTTP door list that id for the base model."""
    if not base_model:
        return
    model = base_model.strip().rstrip("/")
    if name.casefold() in {n.casefold() for n in (model, PurePosixPath(model).name) if n}:
        raise InvalidArgument(
            f"adapter name {name!r} is the base model's name ({base_model[:200]}); "
            "an adapter may not shadow the model it adapts: choose another name",
            field="name",
        )
