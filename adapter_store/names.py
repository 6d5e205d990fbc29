"""Adapter names: what the index keys, file names and events may contain."""

from __future__ import annotations

import re

from adapter_store.errors import InvalidArgument

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Return `name` if it is a valid adapter name, else raise InvalidArgument."""
    if not NAME_RE.fullmatch(name or ""):
        raise InvalidArgument(
            f"adapter name {name!r} is invalid: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit",
            field="name",
            name=name,
        )
    return name
