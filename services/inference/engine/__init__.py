"""The serving engine: scheduler, paged KV cache, model runner, sampler, engine loop.

`build_engine` is imported lazily so that `engine.types` stays light to import.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build_engine":
        from loraplex.services.inference.engine.build import build_engine

        return build_engine
    raise AttributeError(name)
