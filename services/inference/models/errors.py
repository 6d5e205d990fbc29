"""The model loader's one refusal type (its own module: models/config.py and models/config_checks.py
both raise it)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served by this engine; the message says why and what to do."""
