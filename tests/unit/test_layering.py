"""The two services share only the protos: neither imports the other (nor the clients); and no
import cycle, between packages or between modules.

Imports under `if TYPE_CHECKING:` never count. Between packages only module-level imports count;
between modules an import inside a function counts too: deferring an import hides a cycle from
Python but not from the reader, so the shared piece moves to where it belongs instead."""

from __future__ import annotations

import ast
import functools
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "adapter_store": {"services", "clients", "kernels"},
    "services": {"adapter_store", "clients"},
    "kernels": {"services", "adapter_store", "clients"},
}


def _package_of(module: str) -> str:
    """`loraplex.services.inference.x` -> `services`; a name outside the namespace keeps its first part."""
    parts = module.split(".")
    return parts[1] if parts[0] == "loraplex" and len(parts) > 1 else parts[0]


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks here (none of them changes a tree)."""
    return ast.parse(path.read_text(), filename=str(path))


def _imported_packages(path: Path) -> set[str]:
    tree = _parsed(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(_package_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(_package_of(node.module))
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_lane(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) & FORBIDDEN[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}: {bad}"


PACKAGES = ("adapter_store", "services", "kernels", "clients", "bench")


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(("loraplex", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = f
    return mods


def _top_level_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)


# What can hold a statement: statements (bodies of functions, classes, branches, loops, `with`,
# `try`), `except` clauses and `case` blocks. Expressions never do, so the walk below skips them.
_HOLDS_STATEMENTS = (ast.stmt, ast.excepthandler, ast.match_case)


def _all_imports(body: list[ast.AST]):
    """Every import statement at any depth (functions, classes, branches) except under
    `if TYPE_CHECKING:`."""
    pending = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, _HOLDS_STATEMENTS))


def _module_graph(everywhere: bool = False) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """module -> the project modules it imports at module level, or anywhere with `everywhere`
    (`from a import b` counts as `a.b` when that is a module, else as `a`)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        body = _parsed(path).body
        for node in (_all_imports if everywhere else _top_level_imports)(body):
            if isinstance(node, ast.Import):
                deps.update(known(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            deps.update(
                known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in mods else known(base)
                for alias in node.names
            )
        graph[name] = deps - {None, name}
    return graph, mods


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_no_import_cycle_between_modules():
    graph, _ = _module_graph(everywhere=True)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_no_import_cycle_between_packages():
    """A package is a directory (loraplex.services.inference.engine, loraplex.services.inference.lora, ...); a
    module importing a module of its own package or of a sub-package does not count."""
    graph, mods = _module_graph()

    def package(name: str) -> str:
        return name if mods[name].name == "__init__.py" else name.rpartition(".")[0]

    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        a = package(name)
        packages.setdefault(a, set()).update(
            b
            for b in map(package, deps)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + ".")
        )
    cycle = _cycle(packages)
    edges = [
        f"{m} -> {d}"
        for m, ds in sorted(graph.items())
        for d in sorted(ds)
        if cycle and package(m) in cycle and package(d) in cycle and package(m) != package(d)
    ]
    assert cycle is None, f"package import cycle {' -> '.join(cycle)}, through: {edges}"


CONFIG_TAKERS = ("engine", "lora", "parallel")


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any level (function-level imports count here)."""
    names: set[str] = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


# The command line's modules: the ServerArgs type, its checks, the parser and its LoRA flags.
CLI_MODULES = ("server_args", "server_args_checks", "server_flags", "lora_flags")


@pytest.mark.parametrize("package", CONFIG_TAKERS)
def test_engine_lora_and_workers_take_config_objects_not_the_cli_type(package):
    """The engine, LoRA and tensor-parallel code are built from EngineConfig / LoRAConfig /
    LoRASettings; only the server knows the command line (services/inference/server_args.py and
    the other CLI_MODULES)."""
    files = sorted((ROOT / "services" / "inference" / package).rglob("*.py"))
    assert files
    cli = {f"loraplex.services.inference.{m}" for m in CLI_MODULES}
    bad = {str(f.relative_to(ROOT)): sorted(_imported_modules(f) & cli) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"these import the command line's modules: {bad}"


@pytest.mark.parametrize("module", CLI_MODULES)
def test_server_args_does_not_reach_back_into_proto_convert(module):
    """proto_convert reads ServerArgs; the adapter name rule both need lives in lora/names.py, so
    no import, not even one inside a function, runs the other way."""
    assert (ROOT / "services" / "inference" / f"{module}.py").exists(), module
    imported = _imported_modules(ROOT / "services" / "inference" / f"{module}.py")
    assert not {m for m in imported if m.startswith("loraplex.services.inference.proto_convert")}
