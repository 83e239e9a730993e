"""No import cycle in the package.

The graph is built from the source with :mod:`ast`, one node per module of ``asynchdf5``, and an
edge wherever a module imports another module of the package. The rule:

* Every import counts, wherever it is: at module level, inside a function or a class, under
  ``try``. A lazy import that dodges a cycle at import time still runs, and the two modules still
  need each other: it is still a cycle.
* Imports under ``if TYPE_CHECKING:`` do not count: they name types for the type checker and
  never run (the ``else:`` branch does count).
* Imports of other packages are not in the graph. Optional dependencies (fsspec, obstore, torch,
  CuPy) are imported lazily so that the package imports without them; that is what a lazy
  import is for, and it can never close a cycle of ours.
* ``from P import name`` depends on ``P`` (its ``__init__`` runs, or is running, and its
  namespace is read) and on ``P.name`` when that is a module; ``import P.M`` depends on ``P.M``.
  Imports by a computed name (``importlib.import_module``) are not seen.

The cycles are the strongly connected components of more than one module. Any that must be lived
with for a while is listed, once, in :data:`KNOWN_CYCLES` (none now): each may shrink or vanish,
but no module may join one and no other cycle may appear.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import asynchdf5

#: Import cycles tolerated: none. A cycle that must be lived with for a while is listed here, once.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def modules(root: Path) -> dict[str, Path]:
    """The modules of the package in folder ``root``, by dotted name (a package by its own)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    """Whether ``test`` is ``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


class _Imports(ast.NodeVisitor):
    """The modules of ``known`` that module ``name`` (a package if ``package``) imports."""

    def __init__(self, name: str, package: bool, known: Iterable[str]) -> None:
        self.name = name
        self.package = name if package else name.rpartition(".")[0]
        self.known = set(known)
        self.found: set[str] = set()

    def _add(self, *names: str) -> None:
        self.found |= {n for n in names if n in self.known and n != self.name}

    def visit_If(self, node: ast.If) -> None:
        if _type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self._add(*(alias.name for alias in node.names))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        self._add(target, *(f"{target}.{alias.name}" for alias in node.names))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package in folder ``root``, with the modules of it that it imports."""
    found = modules(root)
    graph = {}
    for name, path in found.items():
        visitor = _Imports(name, path.name == "__init__.py", found)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = visitor.found
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe(cycle: frozenset[str], graph: Mapping[str, set[str]]) -> str:
    """The imports within ``cycle``, one per line."""
    return "\n".join(f"  {a} -> {b}" for a in sorted(cycle) for b in sorted(graph[a] & cycle))


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph(Path(asynchdf5.__file__).parent)
    assert "asynchdf5._sources._remote._source" in graph  # the walk found the package's modules
    new = [c for c in cycles(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles:\n" + "\n\n".join(describe(c, graph) for c in new)


def test_the_graph_counts_lazy_imports_but_not_type_only_ones(tmp_path: Path) -> None:
    """The rule above, on a package made for it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "A = 1\ndef f():\n    from . import b\n",  # lazy: counts
        "b.py": "from .a import A\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
        "d.py": "import pkg.c\nimport numpy\nD = 1\n",  # numpy: outside the graph
        "sub/__init__.py": "",
        "sub/e.py": "from .. import c\nfrom ..sub import f\n",
        "sub/f.py": "try:\n    import pkg.sub.e\nexcept ImportError:\n    pass\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.c"] == set()
    assert graph["pkg.d"] == {"pkg.c"}
    assert graph["pkg.sub.e"] == {"pkg", "pkg.c", "pkg.sub", "pkg.sub.f"}
    assert sorted(map(sorted, cycles(graph))) == [
        ["pkg", "pkg.a", "pkg.b"],  # through the lazy import, and the package's __init__
        ["pkg.sub.e", "pkg.sub.f"],  # through the import under try
    ]
