"""The package's imports run one way: no module of deltacp imports (at load time or inside a function)
a module that imports it back, directly or through others. Checked on the source (every `import` and
`from ... import` statement of bindings/python/deltacp, parsed with ast), and by importing the modules
that once formed circles first, each in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "bindings" / "python" / "deltacp"

def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> list:
    """The deltacp modules an ImportFrom names (`from .x import y` may name module x.y)."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph() -> dict:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_pkg, node)
            else:
                continue
            for t in targets:
                # Importing a submodule loads its parent packages first; a package that imports its own
                # submodules is the usual layout, not a circle, so edges go to the module itself only.
                if t in files and t != name and not name.startswith(t + "."):
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    """The parser finds the edges it must (so that an empty cycle list means something)."""
    g = import_graph()
    assert "deltacp.cp.context" in g["deltacp.cp.ops"]
    assert "deltacp._calls" in g["deltacp.cp.local"]
    assert "deltacp.cp" in g["deltacp.ops"]  # cp_context= hands the call to deltacp.cp (inside a function)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


@pytest.mark.parametrize("module", ["deltacp.cp.ops", "deltacp.cp.nccl_backend", "deltacp.cp.context",
                                    "deltacp.cp.autograd"])
def test_fresh_import(module):
    """The modules that were in circles import first in a fresh interpreter."""
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
