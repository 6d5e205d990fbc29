"""bench/ is one tool: modules of one package run as `python -m loraplex.bench.NAME`, never edit sys.path,
write their JSON through the one `--out DIR` flag (bench/results.py), and set no private attribute
of what they measure (LLMEngine.step_timer is the engine's timing hook)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODULES = sorted(BENCH.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _is_main_script(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def test_bench_is_a_namespace_subpackage():
    """Imported as loraplex.bench; no `__init__.py`, so a checkout on sys.path shadows no `bench`."""
    assert not (BENCH / "__init__.py").exists()
    assert MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_sys_path_edits(path):
    uses = [
        ast.unparse(n) for n in ast.walk(_tree(path)) if isinstance(n, ast.Attribute) and n.attr == "path"
    ]
    assert not [u for u in uses if u.startswith("sys.")], f"{path.name} edits sys.path"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_scripts_write_json_through_the_one_out_flag(path):
    tree = _tree(path)
    if not _is_main_script(tree):
        return
    called = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "write_json" in called, f"{path.name}: write the JSON with loraplex.bench.results.write_json"
    flags = {c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert not flags & {"--out", "--json"}, (
        f"{path.name}: take --out from loraplex.bench.results.add_out_argument"
    )
    doc = ast.get_docstring(tree) or ""
    shown = f"-m loraplex.bench.{path.stem}"
    assert shown in doc, f"{path.name}: the docstring shows `python {shown}`"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_private_attribute_is_set(path):
    private = [
        ast.unparse(t)
        for n in ast.walk(_tree(path))
        if isinstance(n, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete)
        for t in (n.targets if isinstance(n, ast.Assign | ast.Delete) else [n.target])
        if isinstance(t, ast.Attribute) and t.attr.startswith("_") and ast.unparse(t.value) != "self"
    ]
    assert not private, f"{path.name} patches private attributes: {private}"
