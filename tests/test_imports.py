"""No import cycle in the package, and no cycle at run time either.

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

At run time, control may still go back up through an object handed down (a callback, a bound
method of the layer): the import graph cannot see that. So an open layer's consumer is walked
(its opening, reader, runs, planner, everything of ours it reaches) for anything defined in a
module above it in ``[tool.importlinter]``'s stages: none may be there, opened with ``with`` or
with ``async with``, with one source or several streams, in this process or with a helper.

And the route of docs/architecture.md: every call into a module of ours from outside it is
recorded (:func:`sys.setprofile`) during construction and during ``async with``, and the route's
stages must be entered in its order, each once.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

import asynchdf5
from asynchdf5 import AsyncHDF5DataLayer, HDF5DataLayer, Stream
from asynchdf5._layer import LayerBase

from ._files import write_source

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

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


def stages() -> list[list[str]]:
    """The stages of ``[tool.importlinter]``'s first contract, top first: each a list of
    modules (a package stands for its modules)."""
    pyproject = Path(asynchdf5.__file__).parent.parent / "pyproject.toml"
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    return [re.split(r"\s*\|\s*", row) for row in contracts[0]["layers"]]


def stage_of(module: str, rows: list[list[str]]) -> int | None:
    """The stage ``module`` is in (None: not ours, or in no stage)."""
    for k, row in enumerate(rows):
        if any(module == m or module.startswith(m + ".") for m in row):
            return k
    return None


def module_of(cls: type) -> str:
    """Where ``cls`` is defined (a public class says ``asynchdf5``, where it is re-exported:
    its functions still say their module)."""
    for value in vars(cls).values():
        if isinstance(value, types.FunctionType):
            return value.__module__
    return cls.__module__


def reached_from_above(root: object, below: int, rows: list[list[str]]) -> list[str]:
    """What ``root`` reaches (through our objects' attributes and plain containers, never a
    weak reference) that is defined in a stage above ``below``: functions, methods, partials,
    or objects of our classes; each as ``path: what``."""
    found: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [("consumer", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            todo.append((f"{path}.func", obj.func))
            todo += [(f"{path}.args", a) for a in obj.args]
            continue
        if isinstance(obj, types.MethodType):
            todo.append((f"{path}.__self__", obj.__self__))
            obj = obj.__func__
        if isinstance(obj, types.FunctionType):
            stage = stage_of(obj.__module__, rows)
            if stage is not None and stage < below:
                found.append(f"{path}: {obj.__module__}.{obj.__qualname__}")
            continue
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo += [(f"{path}[]", v) for v in obj]
            continue
        if isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            continue
        module = module_of(type(obj))
        if not module.startswith("asynchdf5."):
            continue  # not ours: numpy, anyio, threads, files, weak references ...
        stage = stage_of(module, rows)
        if stage is not None and stage < below:
            found.append(f"{path}: a {module}.{type(obj).__qualname__}")
        fields = dict(getattr(obj, "__dict__", {}))
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
        todo += [(f"{path}.{k}", v) for k, v in fields.items()]
    return found


def check_nothing_from_above(layer: LayerBase) -> None:
    rows = stages()
    below = stage_of("asynchdf5._consumer", rows)
    assert below is not None and stage_of("asynchdf5._sync", rows) is not None
    consumer = layer._consumer
    assert consumer.opened is not None and consumer.run is not None  # open, a run going
    found = reached_from_above(consumer, below, rows)
    assert not found, "the consumer reaches code above it:\n" + "\n".join(sorted(found))


def test_the_walk_finds_a_callback_from_above() -> None:
    """The check itself: a bound method of a layer, a partial of it, or a layer object held
    anywhere below the consumer is found."""
    rows = stages()
    below = stage_of("asynchdf5._consumer", rows)
    assert below is not None
    layer = asynchdf5.MemoryDataLayer({"x": [1, 2, 3]}, batch_size=1)
    consumer = layer._consumer
    assert not reached_from_above(consumer, below, rows)
    for held in (layer.close, functools.partial(print, layer), [{"k": layer}]):
        consumer.stats.consumer.stream_samples = {"x": held}  # type: ignore[dict-item]
        assert reached_from_above(consumer, below, rows)


@pytest.mark.parametrize("streams", [False, True], ids=["one source", "streams"])
@pytest.mark.parametrize("process", [False, True], ids=["here", "helper"])
def test_no_callback_from_the_consumer_up_when_opened_with_with(
    tmp_path: Path, streams: bool, process: bool
) -> None:
    lst, files = write_source(tmp_path, (40, 40))
    source: Any = {"a": Stream(files[0]), "b": Stream(files[1])} if streams else lst
    with HDF5DataLayer(source, batch_size=10, shuffle=True, seed=1, process=process) as layer:
        it = iter(layer)
        next(it)
        check_nothing_from_above(layer)
        assert sum(1 for _ in it) == 7


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_no_callback_from_the_consumer_up_when_opened_with_async_with(
    tmp_path: Path,
) -> None:
    _, files = write_source(tmp_path, (40, 40))
    source = {"a": Stream(files[0]), "b": Stream(files[1])}
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(source, batch_size=10, shuffle=True, seed=1) as layer:
            it = aiter(layer)
            await anext(it)
            check_nothing_from_above(layer)
            assert len([b async for b in it]) == 7


#: The stages construction passes through (a mapping of streams), in order. The source seam
#: is left out: the layer reaches it for its options, and each stream's files through it.
CONSTRUCTION_ROUTE = [
    "asynchdf5._hdf5",
    "asynchdf5._config",
    "asynchdf5._streams",
    "asynchdf5._layer",
    "asynchdf5._delivery",
    "asynchdf5._planner",
    "asynchdf5._consumer",
    "asynchdf5._place",
]


#: The stages an ``async with`` passes through, in the order the opening enters each (the
#: consumer twice: marked opening before any await, then adopting what the opening built).
OPENING_ROUTE = [
    "asynchdf5._layer",
    "asynchdf5._consumer",
    "asynchdf5._hdf5",
    "asynchdf5._sizing",
    "asynchdf5._planner",
    "asynchdf5._opened",
    "asynchdf5._consumer",
]


def _entered(frame: types.FrameType, seen: set[types.FrameType]) -> str | None:
    """The module of ours that ``frame`` enters from outside it (None: a call within a module
    already on the stack, a coroutine resumed, or not ours)."""
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("asynchdf5") or frame in seen:
        return None
    seen.add(frame)  # a coroutine resumed after an await calls the same frame again
    caller = frame.f_back
    while caller is not None:
        if caller.f_globals.get("__name__") == module:
            return None
        caller = caller.f_back
    return str(module)


@contextlib.contextmanager
def entries_recorded() -> Iterator[list[str]]:
    """The modules of ours that the block enters (see :func:`_entered`), in order, on this
    thread (a worker thread's calls are not seen)."""
    seen: set[types.FrameType] = set()
    entries: list[str] = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            module = _entered(frame, seen)
            if module is not None:
                entries.append(module)

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield entries
    finally:
        sys.setprofile(before)
        seen.clear()


def test_construction_enters_each_stage_once_in_the_route_s_order(tmp_path: Path) -> None:
    """docs/architecture.md's route of construction, with a mapping of streams (whose own tops
    transformers may name): the config is checked first, then the streams, each once."""
    _, files = write_source(tmp_path, (40, 40))
    source = {"a": Stream(files[0]), "b": Stream(files[1])}
    with entries_recorded() as entries:
        AsyncHDF5DataLayer(source, batch_size=10, seed=1)
    route = [m for m in entries if m in CONSTRUCTION_ROUTE]
    assert route == CONSTRUCTION_ROUTE, entries


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_opening_enters_each_stage_once_in_the_route_s_order(tmp_path: Path) -> None:
    """docs/architecture.md's route of ``async with``: control goes down once. Every call into
    a module of ours from outside it is recorded on the opening's thread (a worker thread's
    catalog aside), and the route's stages are entered in order, each once (the consumer
    twice, as the route says): the sizes of the order are fixed in ``_sizing`` before the
    planner is reached, never by the planner's heuristics from inside ``_sizing``."""
    lst, _ = write_source(tmp_path, (40, 40))
    layer = AsyncHDF5DataLayer(lst, batch_size=10, shuffle=True, seed=1)
    with anyio.fail_after(30):
        with entries_recorded() as entries:
            await layer.__aenter__()
        try:
            route = [m for m in entries if m in OPENING_ROUTE]
            assert route == OPENING_ROUTE, entries
        finally:
            await layer.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_elastic_resume_s_opening_enters_each_stage_once(tmp_path: Path) -> None:
    """The same route when a state saved by one rank is resumed on three, whose own chunks are
    smaller than the saved run's (chunk_size above a rank's share): the slots are sized for the
    saved chunks, and their budget checked, in ``_sizing`` before the planner, never by going
    back to ``_sizing`` after it; the cache's slots are allocated in one visit to ``_cache``."""
    lst, _ = write_source(tmp_path, (40, 40))
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=1, chunk_size=2**20, mmap=False)
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(lst, **kw) as saved:
            async for _ in saved:
                pass
            it = aiter(saved)
            await anext(it)
            state = saved.state_dict()
            await it.aclose()
        own = AsyncHDF5DataLayer(lst, rank=1, world_size=3, **kw).state_dict()
        assert own["fingerprint"]["chunk_rows"] < state["fingerprint"]["chunk_rows"] == 80
        layer = AsyncHDF5DataLayer(lst, rank=1, world_size=3, **kw)
        layer.load_state_dict(state)
        with entries_recorded() as entries:
            await layer.__aenter__()
        try:
            assert layer._consumer.opened is not None
            assert layer._consumer.opened.slot_rows == 80  # the saved run's chunks
            route = [m for m in entries if m in [*OPENING_ROUTE, "asynchdf5._cache"]]
            expected = [*OPENING_ROUTE[:5], "asynchdf5._cache", *OPENING_ROUTE[5:]]
            assert route == expected, entries
            assert len([b async for b in layer]) > 0
        finally:
            await layer.aclose()


def _map_names() -> set[str]:
    """The names in the first column of docs/architecture.md's module map."""
    doc = (Path(asynchdf5.__file__).parents[1] / "docs" / "architecture.md").read_text()
    table = doc.split("## The module map", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


def test_the_module_map_names_every_module_of_the_package_and_no_other() -> None:
    """Each top-level module (or subpackage, as ``name/``) is in the map, and each name there
    exists: the map is the reader's first way in, and a module added or renamed must show."""
    package = Path(asynchdf5.__file__).parent
    modules = {p.name for p in package.glob("*.py")}
    modules |= {p.parent.name + "/" for p in package.glob("*/__init__.py")}
    named = _map_names()
    assert sorted(modules - named) == []
    assert sorted(named - modules) == []
