"""Imports inside the package go one way: no cycles, and no layer asks anything of a layer above it.

Every ``import`` counts, lazy ones inside functions included: a lazy import hides a cycle from
Python's import machinery, not from the reader who has to learn the modules in some order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trl_tree"

#: Layers from the bottom up; a module may import only from its own layer or those below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("trl_tree._device", "trl_tree._inputs", "trl_tree.options", "trl_tree.forest", "trl_tree.model_parts", "trl_tree.router",
     "trl_tree.lm_head", "trl_tree.layout", "trl_tree.cost_model"),
    ("trl_tree.attention",),
    ("trl_tree.packed",),
    ("trl_tree.graphs", "trl_tree.dfs"),
    ("trl_tree.engine",),
)


def module_imports(package: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the package: line}}`` for every ``.py`` file under ``package``."""
    root = package.name
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    edges: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    hit = sub if sub in files else target if target in files else None
                    if hit is not None and hit != name:
                        found.setdefault(hit, node.lineno)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files and alias.name != name:
                        found.setdefault(alias.name, node.lineno)
        edges[name] = {m: line for m, line in found.items() if m == root or m.startswith(root + ".")}
    return edges


def import_cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def _layer_of(module: str) -> int | None:
    for level, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return level
    return None


def test_the_package_has_no_import_cycle():
    edges = module_imports(PACKAGE)
    cycles = import_cycles(edges)
    described = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} (line {edges[a][b]})" for a in c for b in edges[a]
                                                     if b in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_no_layer_imports_from_a_layer_above_it():
    edges = module_imports(PACKAGE)
    upward = [f"{a} (layer {_layer_of(a)}) imports {b} (layer {_layer_of(b)}) at line {line}"
              for a, targets in edges.items() for b, line in targets.items()
              if _layer_of(a) is not None and _layer_of(b) is not None and _layer_of(b) > _layer_of(a)]
    assert not upward, "\n".join(upward)


def test_the_check_finds_a_cycle_hidden_in_a_lazy_import(tmp_path):
    pkg = tmp_path / "trl_tree"
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .inner.high import g\n    return g\n")
    (pkg / "inner" / "high.py").write_text("from ..low import f\n\ndef g():\n    return f\n")
    (pkg / "alone.py").write_text("import trl_tree.low\n")
    edges = module_imports(pkg)
    assert edges["trl_tree.alone"] == {"trl_tree.low": 1}
    assert import_cycles(edges) == [["trl_tree.inner.high", "trl_tree.low"]]


@pytest.mark.parametrize("module", ["trl_tree.dfs.walk"])
def test_each_layer_imports_on_its_own(module):
    """A module whose import needs a module above it to be imported first is a cycle Python hides."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
