"""Both engines implement the one `Engine` interface: every member, with the same parameters and
the same sync/async kind (a coroutine where the call waits, a plain method where it does not)."""

from __future__ import annotations

import inspect

import pytest

from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.async_engine import AsyncEngine
from loraplex.services.inference.parallel.tp_engine import TPAsyncEngine

MEMBERS = sorted(
    name for name, value in vars(Engine).items() if inspect.isfunction(value) and not name.startswith("_")
)


def as_engines(single: AsyncEngine, tp: TPAsyncEngine) -> tuple[Engine, Engine]:
    """Never called: a type checker rejects these assignments when a class drifts from `Engine`."""
    return single, tp


def _kind(fn) -> str:
    if inspect.isasyncgenfunction(fn):
        return "async generator"
    return "coroutine" if inspect.iscoroutinefunction(fn) else "plain"


def _parameters(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_interface_names_what_callers_use():
    assert {"generate", "abort", "load_adapter", "unload_adapter", "shutdown", "model_info"} <= set(MEMBERS)
    waits = {name for name in MEMBERS if _kind(getattr(Engine, name)) == "coroutine"}
    assert waits == {"load_adapter", "unload_adapter", "shutdown"}


@pytest.mark.parametrize("cls", [AsyncEngine, TPAsyncEngine], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", MEMBERS)
def test_engine_implements_member(cls, name):
    want = getattr(Engine, name)
    got = getattr(cls, name, None)
    assert callable(got), f"{cls.__name__} has no {name}"
    assert _kind(got) == _kind(want), f"{cls.__name__}.{name} is {_kind(got)}, Engine says {_kind(want)}"
    assert _parameters(got) == _parameters(want), f"{cls.__name__}.{name}{inspect.signature(got)}"
