"""The adapter name rule, shared by the request checks and the `--lora-paths` flag.

Same rule as the adapter store's (adapter_store/names.py): no '/', no '..' start, no control
characters, so no path can hide in a name.
"""

from __future__ import annotations

import re

ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ADAPTER_NAME_RULE = "use 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit"


def is_adapter_name(name: str) -> bool:
    return ADAPTER_NAME_RE.fullmatch(name) is not None
