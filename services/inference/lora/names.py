"""The adapter name rule, shared by the request checks and the `--lora-paths` flag.

Same rule as the adapter store's (adapter_store/names.py): no '/', no '..' start, no control
characters, so no path can hide in a name.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ADAPTER_NAME_RULE = "use 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit"


def is_adapter_name(name: str) -> bool:
    return ADAPTER_NAME_RE.fullmatch(name) is not None


def served_model_names(model: str) -> set[str]:
    """The names a client may use for the base model `model` (a path or Hub id): the whole string
    and its last part (what the HTTP door lists by default), compared case-insensitively."""
    model = model.strip().rstrip("/")
    return {n.casefold() for n in (model, PurePosixPath(model).name) if n}


def is_served_model_name(name: str, model: str) -> bool:
    """An adapter called `name` would shadow the base model: `/v1/models` would list the id twice,
    and the door (base model) and gRPC (adapter) would disagree on what it means."""
    return name.casefold() in served_model_names(model)
