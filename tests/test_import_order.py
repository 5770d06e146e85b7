"""Imports inside the package go one way: no cycles, and no layer asks anything of a layer above it.

Every ``import`` counts, lazy ones inside functions included: a lazy import hides a cycle from
Python's import machinery, not from the reader who has to learn the modules in some order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trl_tree"

#: The package's rooms from the bottom up (DESIGN.md, "Layout"): a module may import only from its own
#: room or those below it. ``data/`` (users' data, the tiny models) sits below them all.
ROOMS: tuple[tuple[str, ...], ...] = (
    ("trl_tree.data",),
    ("trl_tree.engine",),
    ("trl_tree.distributed",),
    ("trl_tree.trainers",),
    ("trl_tree.inspection",),
    ("trl_tree.bench",),
    ("trl_tree.tools",),
)

#: Inside the engine, from the bottom up: the forest and the model's parts, the attention (which asks
#: nothing of the walk), the packed pass, the CUDA graphs and the walk that reuse it, the entry points.
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    tuple(f"trl_tree.engine.{m}" for m in ("_device", "_inputs", "options", "forest", "model_parts", "router",
                                           "lm_head", "layout", "cost_model")),
    ("trl_tree.engine.attention",),
    ("trl_tree.engine.packed",),
    ("trl_tree.engine.graphs", "trl_tree.engine.dfs"),
    ("trl_tree.engine.api",),
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


def _layer_of(module: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    for level, members in enumerate(layers):
        if any(module == m or module.startswith(m + ".") for m in members):
            return level
    return None


def test_the_package_has_no_import_cycle():
    edges = module_imports(PACKAGE)
    cycles = import_cycles(edges)
    described = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b} (line {edges[a][b]})" for a in c for b in edges[a]
                                                     if b in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def _upward(edges: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    return [f"{a} (layer {_layer_of(a, layers)}) imports {b} (layer {_layer_of(b, layers)}) at line {line}"
            for a, targets in edges.items() for b, line in targets.items()
            if _layer_of(a, layers) is not None and _layer_of(b, layers) is not None
            and _layer_of(b, layers) > _layer_of(a, layers)]


def test_no_room_imports_from_a_room_above_it():
    upward = _upward(module_imports(PACKAGE), ROOMS)
    assert not upward, "\n".join(upward)


def test_no_engine_layer_imports_from_a_layer_above_it():
    upward = _upward(module_imports(PACKAGE), ENGINE_LAYERS)
    assert not upward, "\n".join(upward)


def test_every_module_lives_in_a_room():
    """The top level holds the rooms, the lazy public names and ``inspection.py``, nothing else."""
    loose = sorted(m for m in module_imports(PACKAGE) if m not in ("trl_tree", "trl_tree.__main__")
                   and _layer_of(m, ROOMS) is None)
    assert not loose, f"modules outside the rooms: {loose}"


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


@pytest.mark.parametrize("module", ["trl_tree.engine.dfs.walk", "trl_tree.engine.forest", "trl_tree.distributed.window",
                                    "trl_tree.data.toy"])
def test_each_layer_imports_on_its_own(module):
    """A module whose import needs a module above it to be imported first is a cycle Python hides."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_one_engine_module_loads_only_what_it_imports():
    """``engine/__init__`` re-exports the engine's public names lazily: importing the forest (what the
    cost model, the sampler and ``inspect`` need) loads neither the attention nor the entry points,
    while ``from trl_tree.engine import tree_backward`` still works."""
    import subprocess
    import sys

    code = ("import sys, trl_tree.engine.forest; "
            "print(sorted(m for m in sys.modules if m.startswith('trl_tree.engine.'))); "
            "from trl_tree.engine import tree_backward, PrefixForest, TreeOptions; print(tree_backward.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, module = done.stdout.strip().splitlines()
    assert loaded == "['trl_tree.engine._inputs', 'trl_tree.engine._lazy', 'trl_tree.engine.forest']"
    assert module == "trl_tree.engine.api"
