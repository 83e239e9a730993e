"""What ``asynchdf5 pack`` reads: arrays (``.npy``, ``.npz``), tables (CSV, Parquet) and HDF5
files, each as an :class:`Input` that hands out rows in any order, a block at a time.

Images have their own module (:mod:`._pack_images`): they are decoded in a process pool.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np
import numpy.typing as npt

from .. import DataLayerError
from .._catalog import find_top, group_top_words
from .._sources import is_hdf5_file, resolve_source
from ._pack_write import PackError, TopSpec, temporary_prefix

__all__ = [
    "ArrayInput",
    "Block",
    "Input",
    "Rows",
    "hdf5_input",
    "npy_input",
    "npz_input",
    "table_input",
]

#: Rows handed out per block: about this many bytes of samples.
BLOCK_BYTES = 32 * 2**20
Index = npt.NDArray[np.int64]


@dataclass
class Block:
    """Rows of the output, in output order: ``planned`` items of the plan, of which those in
    ``skipped`` (what, why) could not be read and are not in ``rows``."""

    rows: dict[str, np.ndarray]
    planned: int
    skipped: list[tuple[str, str]] = field(default_factory=list)


class Input(Protocol):
    """An input of ``pack``: ``n`` items, written as the tops ``specs``."""

    description: str
    n: int
    specs: dict[str, TopSpec]
    #: Integer class of each item, when known (the split is then stratified by class).
    labels: Index | None
    #: Names of the classes, stored as the files' ``classes`` attribute.
    classes: list[str] | None
    #: Other attributes for the files (e.g. the feature columns of a table).
    attrs: dict[str, Any]

    def blocks(self, order: Index, cuts: Sequence[int]) -> Generator[Block, None, None]:
        """The items ``order`` (input indices, in output order) as blocks; no block crosses
        one of ``cuts`` (positions in ``order`` where an output file ends)."""
        ...

    def close(self) -> None: ...


def _check_dtype(what: str, dtype: np.dtype[Any]) -> None:
    if dtype.kind not in "biufc" or dtype.names is not None or dtype.subdtype is not None:
        raise PackError(
            f"{what} has dtype {dtype}; the layer reads only bool, integer, float and complex data"
        )


class Rows:
    """One top's rows: one or more arrays (``np.ndarray``, memory maps, h5py datasets) whose
    rows are concatenated."""

    def __init__(self, name: str, parts: Sequence[Any]) -> None:
        self.name, self.parts = name, list(parts)
        shapes = {tuple(int(s) for s in p.shape[1:]) for p in self.parts}
        # Native byte order: the layer reads it without a swap.
        dtypes = {np.dtype(p.dtype).newbyteorder("=") for p in self.parts}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise PackError(
                f"the inputs' {name!r} arrays differ in sample shape or dtype "
                f"({sorted(shapes)}, {sorted(map(str, dtypes))}); they must agree to be one top"
            )
        if any(len(p.shape) == 0 for p in self.parts):
            raise PackError(f"{name!r} is a scalar (0-d) array; a top needs one row per sample")
        self.spec = TopSpec(shapes.pop(), dtypes.pop())
        _check_dtype(repr(name), self.spec.dtype)
        self.starts = np.cumsum([0] + [int(p.shape[0]) for p in self.parts])
        self.n = int(self.starts[-1])

    def take(self, index: Index) -> np.ndarray:
        """Rows ``index``, in that order."""
        if len(self.parts) == 1:
            return _take(self.parts[0], index)
        out = np.empty((len(index), *self.spec.shape), self.spec.dtype)
        part = np.searchsorted(self.starts, index, side="right") - 1
        for p in np.unique(part):
            where = part == p
            out[where] = _take(self.parts[p], index[where] - self.starts[p])
        return out


def _take(a: Any, index: Index) -> np.ndarray:
    """Rows ``index`` of ``a``: a slab read when they are close together (sequential input, or
    a split of it), else a gather in sorted order (kind to memory maps and the page cache)."""
    if len(index) == 0:
        return np.empty((0, *a.shape[1:]), a.dtype)
    lo, hi = int(index.min()), int(index.max()) + 1
    if hi - lo <= 4 * len(index) + 1024:
        slab = np.asarray(a[lo:hi])
        return slab if hi - lo == len(index) and index[0] == lo else slab[index - lo]
    if not isinstance(a, np.ndarray):
        raise AssertionError("random rows of an h5py dataset: stage it first")
    order = np.argsort(index, kind="stable")
    out = np.empty((len(index), *a.shape[1:]), a.dtype)
    out[order] = a[index[order]]
    return out


class ArrayInput:
    """Tops whose rows can be taken in any order (arrays in memory or memory-mapped)."""

    def __init__(
        self,
        description: str,
        tops: Mapping[str, Rows],
        *,
        labels: Index | None = None,
        classes: list[str] | None = None,
        attrs: Mapping[str, Any] | None = None,
        stage: Callable[[ArrayInput], None] | None = None,
    ) -> None:
        counts = {name: rows.n for name, rows in tops.items()}
        if len(set(counts.values())) != 1:
            detail = ", ".join(f"{k!r}: {v} rows" for k, v in counts.items())
            raise PackError(
                f"the arrays have different numbers of rows ({detail}); row r of every top "
                "must be the same sample"
            )
        self.description = description
        self.tops = dict(tops)
        self.n = next(iter(counts.values()))
        self.specs = {name: rows.spec for name, rows in self.tops.items()}
        self.labels, self.classes, self.attrs = labels, classes, dict(attrs or {})
        self._stage = stage
        self._closers: list[Callable[[], None]] = []

    def blocks(self, order: Index, cuts: Sequence[int]) -> Generator[Block, None, None]:
        if self._stage is not None and np.any(np.diff(order) < 0):
            stage, self._stage = self._stage, None
            stage(self)  # rows in a random order: from local memory maps, not h5py
        row_bytes = sum(s.row_bytes for s in self.specs.values())
        step = max(1, BLOCK_BYTES // max(1, row_bytes))
        start = 0
        for cut in cuts:
            for lo in range(start, cut, step):
                index = order[lo : min(lo + step, cut)]
                yield Block(
                    {name: rows.take(index) for name, rows in self.tops.items()}, len(index)
                )
            start = cut

    def on_close(self, fn: Callable[[], None]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        while self._closers:
            with contextlib.suppress(Exception):
                self._closers.pop()()


def _class_labels(labels: Rows | None) -> Index | None:
    """Integer labels of a 1-d integer top, for a stratified split (in memory: 8 bytes each)."""
    if labels is None or labels.spec.shape != () or labels.spec.dtype.kind not in "iub":
        return None
    return labels.take(np.arange(labels.n, dtype=np.int64)).astype(np.int64)


# --- .npy and .npz -----------------------------------------------------------------------------


def _load_npy(path: Path) -> np.ndarray:
    try:
        array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise PackError(f"{path}: cannot read it as a .npy array: {exc}") from exc
    return array


def npy_input(paths: Sequence[Path], labels: Sequence[Path]) -> ArrayInput:
    """``.npy`` files (memory-mapped): their rows concatenated as ``data``; ``labels`` files
    likewise as ``label``."""
    tops = {"data": Rows("data", [_load_npy(p) for p in paths])}
    if labels:
        tops["label"] = Rows("label", [_load_npy(p) for p in labels])
    names = ", ".join(str(p) for p in paths)
    return ArrayInput(names, tops, labels=_class_labels(tops.get("label")))


def npz_input(paths: Sequence[Path]) -> ArrayInput:
    """``.npz`` files: one top per array name (each file's arrays are loaded into memory)."""
    arrays: dict[str, list[np.ndarray]] = {}
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as z:
                found = {name: z[name] for name in z.files}
        except (OSError, ValueError) as exc:
            raise PackError(f"{path}: cannot read it as a .npz archive: {exc}") from exc
        if arrays and set(found) != set(arrays):
            raise PackError(
                f"{path} holds the arrays {sorted(found)}, but {paths[0]} holds {sorted(arrays)}"
            )
        for name, a in found.items():
            arrays.setdefault(name, []).append(a)
    if not arrays:
        raise PackError(f"{paths[0]} holds no arrays")
    tops = {name: Rows(name, parts) for name, parts in arrays.items()}
    label = tops.get("label")
    return ArrayInput(", ".join(map(str, paths)), tops, labels=_class_labels(label))


# --- tables ------------------------------------------------------------------------------------


def _pyarrow(packing: str = "a CSV or Parquet table") -> Any:
    """pyarrow (no type information: imported as a module object); where it is missing, a
    PackError that says what needs it (``packing``, the input as the user knows it)."""
    try:
        return importlib.import_module("pyarrow")
    except ImportError as exc:
        raise PackError(
            f'packing {packing} needs pyarrow: pip install ".[pack]" in the asynchdf5 checkout'
        ) from exc


def _read_table(path: Path) -> Any:
    pa = _pyarrow()
    try:
        if path.suffix.lower() == ".csv":
            return importlib.import_module("pyarrow.csv").read_csv(path)
        return importlib.import_module("pyarrow.parquet").read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise PackError(f"{path}: cannot read the table: {exc}") from exc


def _column(table: Any, name: str, path: Path) -> np.ndarray:
    pa = _pyarrow()

    if name not in table.column_names:
        raise PackError(f"{path}: no column {name!r}; the table has {table.column_names}")
    col = table.column(name)
    if col.null_count:
        raise PackError(
            f"{path}: column {name!r} has {col.null_count} missing values; fill or drop them first"
        )
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    values: np.ndarray = np.asarray(col.to_numpy())
    return values


def table_input(
    paths: Sequence[Path], columns: Sequence[str] | None, label: str | None, dtype: np.dtype[Any]
) -> ArrayInput:
    """CSV or Parquet tables (read into memory): the feature ``columns`` (default: every
    numeric column but the label) as ``data`` of shape (rows, columns) in ``dtype``; the
    ``label`` column as ``label``: integers as int64, floats in ``dtype``, strings as the index
    of their class (classes sorted, stored as the ``classes`` attribute)."""
    tables = [(p, _read_table(p)) for p in paths]
    first = tables[0][1]
    if columns is None:
        pa = _pyarrow()

        numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
        columns = [
            f.name
            for f in first.schema
            if f.name != label and any(test(f.type) for test in numeric)
        ]
        if not columns:
            raise PackError(f"{paths[0]}: no numeric column to pack; name them with --columns")
    want = dtype
    data: list[np.ndarray] = []
    raw_labels: list[np.ndarray] = []
    for path, t in tables:
        cols = []
        for name in columns:
            values = _column(t, name, path)
            if values.dtype.kind not in "biuf":
                raise PackError(
                    f"{path}: column {name!r} holds {values.dtype} values, not numbers; leave it "
                    "out of --columns (or make it the --label-column)"
                )
            cols.append(values.astype(want))
        data.append(np.stack(cols, axis=1) if cols else np.empty((t.num_rows, 0), want))
        if label is not None:
            raw_labels.append(_column(t, label, path))
    tops = {"data": Rows("data", data)}
    classes: list[str] | None = None
    labels: Index | None = None
    if label is not None:
        values = np.concatenate(raw_labels)
        if values.dtype.kind in "OUS":
            names, index = np.unique(values.astype(str), return_inverse=True)
            classes, labels = [str(c) for c in names], index.astype(np.int64)
            values = labels
        elif values.dtype.kind in "iub":
            values = values.astype(np.int64)
            labels = values
        else:
            values = values.astype(want)
        tops["label"] = Rows("label", [values])
    attrs = {"columns": np.array(list(columns), dtype=h5py.string_dtype())}
    desc = ", ".join(map(str, paths))
    return ArrayInput(desc, tops, labels=labels, classes=classes, attrs=attrs)


# --- HDF5 --------------------------------------------------------------------------------------


def hdf5_input(source: Path | Sequence[Path], tops: Sequence[str], scratch: Path) -> ArrayInput:
    """HDF5 files (or a source list naming them), repacked: read through h5py, in order; in a
    shuffled order, copied first into memory maps under ``scratch`` (removed afterwards)."""
    try:
        entries = resolve_source(source if isinstance(source, Path) else list(source))
    except DataLayerError as exc:
        raise PackError(str(exc)) from exc
    files: list[h5py.File] = []
    parts: dict[str, list[Any]] = {t: [] for t in tops}
    try:
        for entry in entries:
            if not is_hdf5_file(Path(entry)):
                raise PackError(f"{entry!r} (named in the source) is not an HDF5 file")
            f = h5py.File(entry, "r")
            files.append(f)
            for t in tops:
                parts[t].append(_hdf5_top(str(entry), f, t))
        rows = {t: Rows(t, p) for t, p in parts.items()}
        classes = files[0].attrs.get("classes")
        out = ArrayInput(
            f"{source} ({len(entries)} HDF5 files)",
            rows,
            labels=_class_labels(rows.get("label")) if "label" in rows else None,
            classes=None if classes is None else [str(c) for c in classes],
            stage=lambda inp: _stage(inp, scratch),
        )
    except BaseException:
        for f in files:
            f.close()
        raise
    for f in files:
        out.on_close(f.close)
    return out


class _Field:
    """A field of a compound dataset (pandas' ``to_hdf(format="table")``), as rows: its
    sub-array shape joins the sample shape."""

    def __init__(self, dset: h5py.Dataset, name: str) -> None:
        self._fields = dset.fields(name)
        sub = dset.dtype.fields[name][0]
        self.dtype = sub.base
        self.shape = (*dset.shape, *sub.shape)

    def __getitem__(self, sel: Any) -> np.ndarray:
        return np.asarray(self._fields[sel])


def refuse_group_top(entry: str, f: h5py.File, top: str) -> None:
    """PackError for a ``--tops`` entry that is a group the layer reads as a top (ragged,
    sparse CSR, categorical): pack repacks datasets, and the layer reads such a group as it
    is, so the user is told that rather than that no such dataset exists."""
    form = group_top_words(f.get(top))
    if form is not None:
        raise PackError(
            f"{entry}: top {top!r} is a {form} group, which the layer reads as it is (name it "
            "in the layer's tops); pack repacks datasets only (as rows, and variable-length "
            "ones as ragged groups): leave it out of --tops"
        )


def _hdf5_top(entry: str, f: h5py.File, top: str) -> Any:
    """Top ``top`` of ``f`` as rows, checked as the layer checks it (so a top missing lists
    every dataset of the file, in groups too, and a compound dataset's fields). A group the
    layer reads as a top (ragged, sparse, categorical) is refused by its form: pack repacks
    datasets, and the layer reads such a group as it is."""
    refuse_group_top(entry, f, top)
    try:
        found = find_top(entry, f, top)
    except DataLayerError as exc:
        raise PackError(f"{exc} (choose the tops with --tops)") from exc
    return _Field(found.dset, found.field) if found.field else found.dset


def _stage(inp: ArrayInput, scratch: Path) -> None:
    """Copy every top into a memory-mapped scratch file, in order, so rows can be taken in any
    order at memory (or disk) speed rather than h5py's per-selection cost."""
    for name, rows in list(inp.tops.items()):
        path = scratch / f"{temporary_prefix()}{name.replace('/', '_')}.npy.tmp"
        inp.on_close(functools.partial(path.unlink, missing_ok=True))
        shape = (rows.n, *rows.spec.shape)
        mm = np.lib.format.open_memmap(path, mode="w+", dtype=rows.spec.dtype, shape=shape)
        step = max(1, BLOCK_BYTES // max(1, rows.spec.row_bytes))
        for lo in range(0, rows.n, step):
            hi = min(lo + step, rows.n)
            mm[lo:hi] = rows.take(np.arange(lo, hi, dtype=np.int64))
        mm.flush()
        inp.tops[name] = Rows(name, [mm])
