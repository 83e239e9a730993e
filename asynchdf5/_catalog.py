"""Catalog: the files of a source, their tops, shapes, dtypes and storage layouts.

Built once when a layer is opened, in a worker thread (h5py is only ever called off the event
loop). For each file and top it records exactly where the bytes are, so that the reader never asks
h5py again on the fast paths, and never guesses: a layout is taken by a fast path only when every
byte of it is accounted for here; anything else is read by h5py (which converts, fills and
resolves as HDF5 does), and a layout whose data would silently come out as fill values (a missing
external file, a virtual dataset whose source is gone) is refused with a :class:`SourceError`.

See :mod:`._layout` for how each top's storage is described, and which read path it takes.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import posixpath
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from ._catalog_cache import CatalogCache, Described
from ._errors import DataLayerError, SchemaError, SourceError
from ._layout import ChunkIndex, Extent, Layout, ReadPath, describe
from ._ragged_tops import (
    CSR_MEMBERS,
    RaggedForm,
    RaggedInfo,
    RaggedParts,
    RowLengths,
    find_form,
    group_top,
    group_top_words,
    kind_words,
    member_of_csr,
)
from ._sources import LocalSource, Source, StoredFile, name_entry
from ._windows import Windows, count_windows

__all__ = [
    "ENCODING_ATTR",
    "SHUFFLED_ATTR",
    "Catalog",
    "ChunkIndex",
    "Extent",
    "FileInfo",
    "FoundTop",
    "Layout",
    "ReadPath",
    "Segment",
    "TopInfo",
    "build_catalog",
    "categorical",
    "check_top",
    "compound_field",
    "describe_top",
    "field_dtype",
    "find_top",
    "group_top_words",
    "missing_top",
    "offered_tops",
    "physical",
    "refuse_external_links",
    "same_categories",
]

#: How many of a file's datasets a "top is missing" message lists.
_LIST_AT_MOST = 20

#: The file attribute that says its samples were written in a uniformly random order
#: (``asynchdf5 pack --shuffle`` sets it True): any stretch of its rows is a random draw.
SHUFFLED_ATTR = "shuffled"


@dataclass(frozen=True)
class TopInfo:
    """A top: its name, the dtype of its samples (native byte order) and their shape.

    ``windows``: the top is cut from a 1-D dataset as :class:`~asynchdf5.Windows` ``(length,
    stride)`` (its rows are windows; the layouts say where the dataset's elements are).

    A ragged or sparse top (``ragged`` set, :mod:`._ragged_tops`): ``dtype`` and
    ``sample_shape`` are its values' (the trailing shape of a row), and ``row_bytes`` is what
    a slot keeps per row besides its values: the row's span (two int64).
    """

    name: str
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]
    windows: tuple[int, int] | None = None
    ragged: RaggedInfo | None = field(default=None, compare=False)
    #: Bytes of one sample (computed once: the chunk reader asks for it per byte range).
    row_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ragged is not None:
            object.__setattr__(self, "row_bytes", 16)
            return
        object.__setattr__(self, "row_bytes", self.dtype.itemsize * math.prod(self.sample_shape))

    @property
    def value_bytes(self) -> int:
        """Bytes of one value of a ragged top (with a sparse top's column index)."""
        b = self.dtype.itemsize * math.prod(self.sample_shape)
        if self.ragged is not None and self.ragged.index_dtype is not None:
            b += self.ragged.index_dtype.itemsize
        return b

    @property
    def mean_row_bytes(self) -> float:
        """Bytes a batch holds per row, on average: a ragged top's values count."""
        if self.ragged is None:
            return float(self.row_bytes)
        return self.ragged.mean_values * self.value_bytes + 8


@dataclass(frozen=True, eq=False)
class FileInfo:
    """One file of the source: its row count, where its rows start, and each top's layout."""

    file: StoredFile
    nrows: int
    start: int  # global index of its row 0
    layouts: dict[str, Layout]
    #: Its samples were written in a random order (the :data:`SHUFFLED_ATTR` attribute True).
    shuffled: bool = False
    #: The category names of its tops that are categorical groups (:func:`categorical`).
    categories: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: Its ragged and sparse tops: their ``indptr`` and where their values are.
    ragged: dict[str, RaggedParts] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.file.name


@dataclass(frozen=True)
class Segment:
    """Rows ``row_start:row_stop`` of file ``file``, landing at ``out_start`` of a chunk."""

    file: FileInfo
    row_start: int
    row_stop: int
    out_start: int


@dataclass
class Catalog:
    """Files and tops of a source; maps global index ranges to file segments."""

    files: list[FileInfo]
    tops: dict[str, TopInfo]
    #: The category names of each top that is a categorical group, in code order (the same in
    #: every file: checked when the catalog is built).
    categories: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    n_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_samples = sum(f.nrows for f in self.files)
        # Files with rows only: 0-row files contribute nothing to the global index.
        self._nonempty = [f for f in self.files if f.nrows > 0]
        self._starts = [f.start for f in self._nonempty]
        #: Each file's place in :attr:`files` (the order its ragged tops' lengths are kept in).
        self._index = {id(f): i for i, f in enumerate(self.files)}
        self._bound_ragged()

    def _bound_ragged(self) -> None:
        """Each ragged top's rows' lengths over every file (:class:`RowLengths`, from the
        files' ``indptr``, in global order): they also say where each file's values start
        among all of them (:meth:`values_base`)."""
        for name, t in list(self.tops.items()):
            if t.ragged is None:
                continue
            # In global order: a file without the top (another stream's) gives its rows none.
            pieces = [
                (len(p.indptr) - 1, p.indptr)
                if (p := f.ragged.get(name)) is not None
                else (f.nrows, None)
                for f in self.files
            ]
            lengths = RowLengths(pieces)
            names = tuple(f.name for f in self.files)
            info = dataclasses.replace(t.ragged, lengths=lengths, files=names)
            self.tops[name] = dataclasses.replace(t, ragged=info)

    def values_base(self, file: FileInfo, top: str) -> int:
        """Where ragged top ``top``'s values of ``file`` start among the values of every file
        (a resident heap holds them all in that order)."""
        ragged = self.tops[top].ragged
        assert ragged is not None
        return ragged.lengths.file_base(self._index[id(file)])

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample over all tops (a ragged top's span, not its values)."""
        return sum(t.row_bytes for t in self.tops.values())

    @property
    def mean_row_bytes(self) -> int:
        """Bytes of one sample over all tops, a ragged top's values on average: what the
        order's heuristics (blocks, first read, lanes) size reads by."""
        return max(1, round(sum(t.mean_row_bytes for t in self.tops.values())))

    def read_paths(self) -> dict[str, str]:
        """Read path of each top ("+"-joined when files differ)."""
        paths: dict[str, set[str]] = {t: set() for t in self.tops}
        for f in self._nonempty:
            for top, layout in f.layouts.items():
                parts = f.ragged.get(top)
                if parts is None:
                    paths[top].add(layout.path)
                elif parts.vlen is not None:
                    paths[top].add("vlen-h5py")
                else:
                    inner = {p.path for p in (parts.data, parts.indices) if p is not None}
                    kind = "sparse" if parts.indices is not None else "ragged"
                    paths[top].add(f"{kind}-{'+'.join(sorted(inner))}")
        return {t: "+".join(sorted(p)) or "none" for t, p in paths.items()}

    def read_notes(self) -> dict[str, str]:
        """Why a top is read by h5py, when it is."""
        notes: dict[str, set[str]] = {t: set() for t in self.tops}
        for f in self._nonempty:
            for top, layout in f.layouts.items():
                if layout.note:
                    notes[top].add(layout.note)
        return {t: "; ".join(sorted(n)) for t, n in notes.items() if n}

    def segments(self, start: int, stop: int, out_start: int = 0) -> list[Segment]:
        """The file segments covering global indices ``start:stop``, in order."""
        out: list[Segment] = []
        i = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < stop:
            f = self._nonempty[i]
            r0 = pos - f.start
            r1 = min(f.nrows, stop - f.start)
            out.append(Segment(f, r0, r1, out_start + (pos - start)))
            pos += r1 - r0
            i += 1
        return out


# --- checks ------------------------------------------------------------------------------------


def _pytables_index(obj: object) -> bool:
    """Whether ``obj`` is PyTables' index of a table's columns (a group ``_i_<table>`` whose
    ``CLASS`` attribute is ``TINDEX``, as pandas' ``to_hdf(format="table")`` writes beside
    ``table``): its arrays are sorted copies of a column and bookkeeping, never samples."""
    return isinstance(obj, h5py.Group) and _text(obj.attrs.get("CLASS")) == "TINDEX"


def _visit_data(h5: h5py.File, visit: Callable[[str, object], None]) -> None:
    """``h5.visititems(visit)`` (every object, in groups too, by path without the leading
    ``/``, parents first), leaving out PyTables' column indexes (:func:`_pytables_index`): a
    pandas table's file would otherwise list dozens of them before its data."""
    skipped: list[str] = []

    def each(name: str, obj: object) -> None:
        if any(name.startswith(s) for s in skipped):
            return
        if _pytables_index(obj):
            skipped.append(name + "/")
            return
        visit(name, obj)

    h5.visititems(each)


def _datasets(h5: h5py.File) -> list[tuple[str, tuple[str, ...]]]:
    """Every dataset of the file, in groups too, by path, with the fields of a compound one
    (each a top of its own: :func:`compound_field`). The members of a ragged or sparse group
    are left out: they are refused as tops (the group is named instead); so are PyTables'
    column indexes (:func:`_visit_data`)."""
    found: list[tuple[str, tuple[str, ...]]] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            parent, _, leaf = name.rpartition("/")
            if leaf in CSR_MEMBERS and group_top(h5.get(parent or "/")) in ("ragged", "sparse"):
                return
            found.append(("/" + name, tuple(obj.dtype.names or ())))

    _visit_data(h5, visit)
    return found


def offered_tops(h5: h5py.File) -> list[tuple[str, str | None]]:
    """What the file offers as tops, by path (no leading ``/``), in the file's order: each
    group a layer reads as a top with its form in words, and each dataset of one or more
    dimensions outside such a group (form None): a member of one is refused as a top. A
    compound dataset offers its fields instead (``t/table/index``: a pandas table's columns);
    PyTables' column indexes are no tops (:func:`_visit_data`)."""
    found: list[tuple[str, str | None]] = []

    def visit(name: str, obj: object) -> None:
        words = group_top_words(obj)
        if words is not None:
            found.append((name, words))
        elif isinstance(obj, h5py.Dataset) and obj.shape:
            parent = name.rpartition("/")[0]
            if group_top_words(h5.get(parent or "/")) is None:
                # A compound dataset (a pandas table) is refused as a top; its fields are tops.
                fields = obj.dtype.names or ()
                found.extend([(f"{name}/{f}", None) for f in fields] or [(name, None)])

    _visit_data(h5, visit)
    return found


def _listed(paths: list[str]) -> str:
    out = ", ".join(paths[:_LIST_AT_MOST])
    if len(paths) > _LIST_AT_MOST:
        out += f", ... ({len(paths)} in all)"
    return out


def missing_top(name: str, h5: h5py.File, top: str) -> SchemaError:
    """The error for a top that file ``name`` does not hold: the closest name it does hold
    (a typo, or a letter's case), then the groups read as tops (sparse, ragged, categorical:
    an AnnData file's ``X`` and ``obs`` columns) and the datasets."""
    groups = [("/" + path, words) for path, words in offered_tops(h5) if words is not None]
    found = _datasets(h5)
    have = [path + (f" (fields {', '.join(fields)})" if fields else "") for path, fields in found]
    # A field is named as a top by its dataset's path and its name (a pandas column's).
    names = [path.lstrip("/") for path, _ in groups]
    for path, fields in found:
        names += [path.lstrip("/"), *(f"{path.lstrip('/')}/{f}" for f in fields)]
    by_lower = {n.lower(): n for n in reversed(names)}
    close = difflib.get_close_matches(top.strip("/").lower(), list(by_lower), n=1, cutoff=0.6)
    meant, pandas = _pandas_column(h5, top)
    if meant is None and close:
        meant = by_lower[close[0]]
    hint = (f" Did you mean {meant!r}?" if meant else "") + pandas
    parts = []
    if groups:
        parts.append(f"the groups read as tops {_listed([f'{p!r} ({w})' for p, w in groups])}")
    if have:
        parts.append(f"the datasets {_listed([repr(d) for d in have])}")
    return SchemaError(
        f"{name}: top {top!r} is missing (no such dataset or group in the file).{hint} The "
        "file has " + (", and ".join(parts) if parts else "no datasets")
    )


_DATA_COLUMNS = (
    '`df.to_hdf(path, key=..., format="table", data_columns=True)` stores each column as a '
    "field named by it."
)
_PANDAS_BLOCKS = (
    " pandas stores a table's columns of one dtype together, as the fields values_block_0, "
    f"values_block_1, ... of its 'table' dataset; {_DATA_COLUMNS}"
)
# What PyTables writes for a list of column names (a ``values_block_N_kind`` attribute): a
# protocol-0 pickle of the list, read here as text only (never unpickled).
_PICKLED_NAMES = re.compile(r"\(lp0\n((?:V[^\n]*\np\d+\na)*)\.")
_PICKLED_NAME = re.compile(r"V([^\n]*)\np\d+\na")


def _pandas_table(h5: h5py.File, path: str) -> h5py.Dataset | None:
    """The table dataset of the pandas table (``to_hdf(format="table")``, whose group says
    ``pandas_type="frame_table"``) that ``path`` names: the group, or its ``table``."""
    try:
        obj = h5.get(path) if path else None
        if isinstance(obj, h5py.Group):
            obj = obj.get("table")
    except (KeyError, OSError, TypeError, ValueError):
        return None
    if not isinstance(obj, h5py.Dataset) or not obj.dtype.names:
        return None
    return obj if _text(obj.parent.attrs.get("pandas_type")) == "frame_table" else None


def _block_of(table: h5py.Dataset, column: str) -> tuple[str, int] | None:
    """The ``values_block_N`` field of ``table`` that holds pandas column ``column``, and its
    place among the block's columns (from the field's ``_kind`` attribute); None if unknown."""
    for name in table.dtype.names or ():
        said = table.attrs.get(f"{name}_kind") if name.startswith("values_block_") else None
        if not isinstance(said, bytes | str):
            continue
        # Byte for byte: a name's characters past ASCII are escaped the pickle's way.
        text = said.decode("latin-1") if isinstance(said, bytes) else said
        whole = _PICKLED_NAMES.fullmatch(text)
        names = [_unescaped(n) for n in _PICKLED_NAME.findall(whole.group(1))] if whole else []
        if column in names:
            return name, names.index(column)
    return None


def _unescaped(name: str) -> str:
    """A name as a protocol-0 pickle writes it (raw-unicode-escape), as text."""
    try:
        return name.encode("latin-1").decode("raw_unicode_escape")
    except UnicodeError:
        return name


def _pandas_column(h5: h5py.File, top: str) -> tuple[str | None, str]:
    """For a missing ``top`` that names a column of a pandas table (``df/price`` or
    ``df/table/price``): the top that holds the column (its field, or the block of columns
    pandas kept it in; None if unknown), and what to say of pandas' blocks ("" if nothing)."""
    parent, _, column = top.strip("/").rpartition("/")
    table = _pandas_table(h5, parent)
    if table is None:
        return None, ""
    names = table.dtype.names or ()
    where = table.name.lstrip("/")
    if column in names:  # a data column, named without its table
        return f"{where}/{column}", ""
    block = _block_of(table, column)
    if block is not None:
        return f"{where}/{block[0]}", (
            f" pandas keeps column {column!r} there, as its column {block[1]}, with the other "
            f"columns of its dtype; {_DATA_COLUMNS}"
        )
    return None, _PANDAS_BLOCKS if any(n.startswith("values_block_") for n in names) else ""


def compound_field(h5: h5py.File, top: str) -> tuple[h5py.Dataset, str] | None:
    """The compound dataset and the field that ``top`` names, or None when it names none.

    A field of a compound dataset is a top named by the dataset's path and the field's name:
    ``"t/table/values_block_0"`` is the field ``values_block_0`` of the dataset ``t/table``
    (pandas' ``to_hdf(format="table")``). A dataset or group of that path comes first.
    """
    parent, _, field_name = top.rstrip("/").rpartition("/")
    if not parent or not field_name or _exists(h5, top):
        return None
    try:
        obj = h5.get(parent)
    except (KeyError, OSError, TypeError):
        return None
    if not isinstance(obj, h5py.Dataset) or obj.dtype.names is None:
        return None
    if field_name not in obj.dtype.names:
        return None
    return obj, field_name


def field_dtype(name: str, dset: h5py.Dataset, top: str, field_name: str) -> np.dtype[Any]:
    """The dtype of field ``field_name`` of ``dset`` (a subarray field: its base, whose shape
    joins the sample shape), checked as a top's dtype is."""
    dt: np.dtype[Any] = dset.dtype.fields[field_name][0]
    base: np.dtype[Any] = dt.base if dt.subdtype is not None else dt
    _check_dtype(name, top, base)
    return base


def _check_dtype(name: str, top: str, dt: np.dtype[Any]) -> None:
    """Only numbers are served: the rest gets a message naming the route that works."""
    route = (
        "; store it as numbers (integer codes for categories: `asynchdf5 pack` of a CSV or "
        "Parquet table turns a --label-column of strings into class codes), or leave it out "
        "of the tops"
    )
    if dt.names is not None:
        fields = ", ".join(repr(f"{top.rstrip('/')}/{f}") for f in dt.names)
        raise SchemaError(
            f"{name}: top {top!r} has a compound dtype {dt}; name its fields as tops: {fields}"
        )
    text = h5py.check_string_dtype(dt)
    if text is not None and text.length is not None:
        raise SchemaError(
            f"{name}: top {top!r} holds strings of fixed length ({dt.str.lstrip('|')}, "
            f"{text.length} bytes each); not supported{route}"
        )
    if h5py.check_vlen_dtype(dt) is not None or text is not None:
        raise SchemaError(
            f"{name}: top {top!r} holds strings or variable-length data ({dt}); not "
            f"supported{route}"
        )
    if dt.kind not in "biufc" or dt.subdtype is not None:
        raise SchemaError(
            f"{name}: top {top!r} has dtype {dt}; only bool, integer, float and complex are "
            f"supported{route}"
        )


#: The attribute that names a group's encoding (AnnData's ``encoding-type``).
ENCODING_ATTR = "encoding-type"


def _text(value: object) -> object:
    return value.decode() if isinstance(value, bytes) else value


def categorical(name: str, h5: h5py.File, top: str) -> tuple[str, tuple[Any, ...]] | None:
    """When ``top`` names a categorical column: the path of its codes (the top's rows) and its
    category names, in code order (``str`` for strings, else numbers); None otherwise.

    Two encodings are read: AnnData's (since 0.8), a group with ``encoding-type="categorical"``
    (or a group of exactly the datasets ``codes`` and ``categories``), and the one AnnData
    wrote before, an integer dataset of codes whose attribute ``categories`` is an object
    reference to the dataset of names (``obs/__categories/cell_type``). Raises SchemaError for
    a group that says it is categorical and is not.
    """
    try:
        obj = h5.get(top)
    except (KeyError, OSError, TypeError, ValueError):
        return None
    if isinstance(obj, h5py.Dataset):
        ref = obj.attrs.get("categories") if "categories" in obj.attrs else None
        if not isinstance(ref, h5py.Reference) or not ref:
            return None
        try:
            names = h5[ref]
        except (KeyError, OSError, TypeError, ValueError) as exc:
            raise SchemaError(
                f"{name}: top {top!r}: its `categories` attribute names no dataset ({exc})"
            ) from exc
        if not isinstance(names, h5py.Dataset):
            raise SchemaError(f"{name}: top {top!r}: its `categories` attribute is not a dataset")
        found = _names(name, top, names)
        _codes_in_range(name, top, obj, len(found))
        return top, found
    if not isinstance(obj, h5py.Group):
        return None
    said = _text(obj.attrs.get(ENCODING_ATTR))
    keys = set(obj.keys())
    if said != "categorical" and not (said is None and keys == {"codes", "categories"}):
        return None
    codes, names = obj.get("codes"), obj.get("categories")
    if not isinstance(codes, h5py.Dataset) or not isinstance(names, h5py.Dataset):
        raise SchemaError(
            f"{name}: top {top!r} is a categorical group, but does not hold the datasets "
            f"'codes' and 'categories' (it holds {sorted(keys)})"
        )
    found = _names(name, top, names)
    _codes_in_range(name, top, codes, len(found))
    return f"{top.rstrip('/')}/codes", found


#: Codes checked at a time (:func:`_codes_in_range`): no array of the column's size at open.
_CODE_ROWS = 1 << 20


def _codes_in_range(name: str, top: str, codes: h5py.Dataset, n: int) -> None:
    """SchemaError unless every integer code is ``-1`` (a missing value, as pandas and AnnData
    write it) or names one of the ``n`` categories: a code past them would name none, or
    another column's, in the user's lookup or an embedding. Read once, at open, a block at a
    time (a code is a byte or two a row; ``indptr`` of a ragged top costs eight). Blocking."""
    if codes.dtype.kind not in "iu" or codes.ndim != 1:
        return  # not codes: the dataset checks say what it is
    for a in range(0, codes.shape[0], _CODE_ROWS):
        block = np.asarray(codes[a : a + _CODE_ROWS])
        bad = np.flatnonzero((block < -1) | (block >= n))
        if len(bad):
            r = a + int(bad[0])
            raise SchemaError(
                f"{name}: top {top!r}: code {int(block[bad[0]])} at row {r} names none of its "
                f"{n} categories (a code is 0 to {n - 1}, or -1 for a missing value)"
            )


def _names(name: str, top: str, names: h5py.Dataset) -> tuple[Any, ...]:
    """The category names a dataset holds (strings, or numbers)."""
    if names.ndim != 1:
        raise SchemaError(
            f"{name}: top {top!r}: its categories are of shape {names.shape}, not a list"
        )
    if h5py.check_string_dtype(names.dtype) is not None:
        return tuple(str(_text(v)) for v in names.asstr()[()]) if names.size else ()
    if names.dtype.kind in "biuf":
        return tuple(names[()].tolist())
    raise SchemaError(
        f"{name}: top {top!r}: its categories have dtype {names.dtype}; strings or numbers are read"
    )


@dataclass(frozen=True)
class FoundTop:
    """A top of one file, checked: the dataset that holds it (``field``: the field of its
    compound records that the top is, or ""), and the dtype (native) and shape of a sample."""

    dset: h5py.Dataset
    field: str
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]


def find_top(name: str, h5: h5py.File, top: str) -> FoundTop:
    """Top ``top`` of file ``name``: a dataset (:func:`check_top`) or a field of a compound
    one (:func:`compound_field`). Raises SchemaError or SourceError naming the file."""
    field_of = compound_field(h5, top)
    if field_of is None:
        dset = check_top(name, h5, top)
        shape = tuple(int(s) for s in dset.shape[1:])
        return FoundTop(dset, "", np.dtype(dset.dtype.newbyteorder("=").str), shape)
    dset, field_name = field_of
    if dset.shape is None or len(dset.shape) == 0:
        raise SchemaError(
            f"{name}: top {top!r} is a field of a scalar (0-d) dataset; a top needs one row "
            "per sample"
        )
    native = field_dtype(name, dset, top, field_name).newbyteorder("=")
    sub = dset.dtype.fields[field_name][0].shape
    shape = tuple(int(s) for s in (*dset.shape[1:], *sub))
    return FoundTop(dset, field_name, np.dtype(native.str), shape)


def describe_top(
    source: Source, holder: StoredFile, dset: h5py.Dataset, top: str, field_name: str
) -> Layout:
    """The layout of top ``top`` stored as ``dset`` in ``holder`` (pinned; blocking). A field of
    a compound dataset is read through h5py, which picks it out of the records it reads."""
    layout = describe(source, holder, dset, top)
    if not field_name:
        return layout
    return dataclasses.replace(
        layout,
        path="h5py",
        extents=(),
        chunks=None,
        swap=False,
        dataset_name=dset.name,
        file=holder,
        note="a field of a compound dataset",
        field=field_name,
    )


def _exists(h5: h5py.File, top: str) -> bool:
    """Whether ``top`` is a link of the file (a path through a dataset is not)."""
    try:
        return h5.get(top, getlink=True) is not None
    except (KeyError, OSError, TypeError, ValueError):
        return False


def check_top(name: str, h5: h5py.File, top: str) -> h5py.Dataset:
    try:
        obj = h5.get(top)
    except (KeyError, OSError) as exc:  # a dangling soft or external link
        raise SchemaError(f"{name}: top {top!r} cannot be opened: {exc}") from exc
    if obj is None:
        link = h5.get(top, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise SourceError(
                f"{name}: top {top!r} is an external link to {link.path!r} in "
                f"{link.filename!r}, which cannot be opened (missing, or no such dataset there)"
            )
        if isinstance(link, h5py.SoftLink):
            raise SchemaError(
                f"{name}: top {top!r} is a soft link to {link.path!r}, which does not exist"
            )
        raise missing_top(name, h5, top)
    if not isinstance(obj, h5py.Dataset):
        raise SchemaError(f"{name}: top {top!r} is a {type(obj).__name__}, not a dataset")
    if obj.shape is None or len(obj.shape) == 0:
        raise SchemaError(
            f"{name}: top {top!r} is a scalar (0-d) dataset; a top needs one row per sample"
        )
    _check_dtype(name, top, obj.dtype)
    return obj


def refuse_external_links(name: str, h5: h5py.File, top: str) -> None:
    """In a file that is not local, a top reached through an external link is refused before
    HDF5 follows the link: it would look the target up on the local file system (and h5py's
    file-object driver would read the remote file again in its place). The path is walked link
    by link, soft links resolved by hand, so that HDF5 never traverses an external one."""
    parts = [p for p in top.split("/") if p]
    here, i, hops = "/", 0, 0
    while i < len(parts):
        where = posixpath.join(here, parts[i])
        try:
            link = h5.get(where, getlink=True)
        except (KeyError, OSError, TypeError):
            return  # not there (or not a group on the way): check_top says so
        if isinstance(link, h5py.ExternalLink):
            raise SourceError(
                f"{name}: top {top!r} goes through the external link {where!r} to "
                f"{link.path!r} in {link.filename!r}; external links, external storage and "
                "virtual datasets in remote files are not supported: HDF5 would look the files "
                "they name up on the local file system. Copy the data into the file (h5repack), "
                "or name the target file in the source"
            )
        if isinstance(link, h5py.SoftLink):
            hops += 1
            if hops > 32:
                return  # a loop of soft links: HDF5 refuses it itself
            target = posixpath.normpath(posixpath.join(here, link.path))
            parts = [p for p in target.split("/") if p] + parts[i + 1 :]
            here, i = "/", 0
            continue
        here, i = where, i + 1


# --- the catalog -------------------------------------------------------------------------------


def physical(source: Source, file: StoredFile, dset: h5py.Dataset) -> tuple[StoredFile, Any]:
    """The file that holds ``dset`` and the dataset opened there: the target of an external
    link is another file, whose own bytes the reader must read."""
    if dset.file.id == file.h5py_file().id:
        return file, dset
    other = source.open_link_target(dset.file.filename, file)
    return other, other.h5py_file()[dset.name]


def build_catalog(
    source: Source, entries: Sequence[str], tops: Sequence[str], *, keep: bool = False
) -> Catalog:
    """Open every file once, check the tops and record their layout. Blocking: run in a thread.

    ``keep``: take what h5py said of a local file in an earlier run from the kept catalog, where
    it still describes the file, and keep what it says now (:mod:`._catalog_cache`).

    Raises :class:`SourceError` (a file missing, unreadable, not HDF5, or data that would come
    out as fill values) or :class:`SchemaError` (tops missing or not matching across files),
    naming the file, and where the source named it (a list file's line: :func:`name_entry`).
    Each file is pinned open while it is described; the source may close it afterwards.
    """
    infos: list[FileInfo] = []
    specs: dict[str, TopInfo] = {}
    first_file: dict[str, str] = {}
    touched: dict[int, StoredFile] = {}  # files whose h5py handle was opened
    needed: set[int] = set()  # ... and those the h5py read path goes on using
    kept = CatalogCache.for_entries(entries) if keep and isinstance(source, LocalSource) else None
    start = 0
    for entry in entries:
        try:
            file = source.open(entry)
            with file.pinned():
                info = _describe_file(
                    source, file, tops, start, specs, first_file, touched, needed, kept
                )
        except DataLayerError as exc:
            name_entry(exc, entry)
            raise
        same_categories(info, infos)
        infos.append(info)
        start += info.nrows
    if kept is not None:
        kept.save()
    for key, stored in touched.items():  # the fast paths read through the source, not h5py
        if key not in needed:
            stored.close_h5py()
    if start == 0:
        raise SourceError(
            f"the source's {len(infos)} file(s) hold no samples (every top has 0 rows)"
        )
    return Catalog(infos, specs, dict(infos[0].categories) if infos else {})


def _shown(names: tuple[Any, ...]) -> str:
    listed = ", ".join(repr(n) for n in names[:8])
    return f"[{listed}{', ...' if len(names) > 8 else ''}] ({len(names)})"


def same_categories(info: FileInfo, before: Sequence[FileInfo], where: str = "") -> None:
    """SchemaError unless file ``info`` has the categories of the files ``before`` it: a code
    must name the same category in every file (and a top is categorical in all or none)."""
    if not before:
        return
    first = before[0]
    for top in {*info.categories, *first.categories}:
        mine, theirs = info.categories.get(top), first.categories.get(top)
        if mine == theirs or top not in info.layouts or top not in first.layouts:
            continue  # (a stream's own top is not another's)
        if mine is None or theirs is None:
            has, lacks = (info, first) if mine is not None else (first, info)
            raise SchemaError(
                f"{where}{info.name}: top {top!r} is a categorical group in {has.name} and not "
                f"in {lacks.name}; its codes would mean different things"
            )
        raise SchemaError(
            f"{where}{info.name}: top {top!r} has the categories {_shown(mine)}, but "
            f"{first.name} has {_shown(theirs)}: a code must name the same category in every "
            "file (recode them to one list of categories, e.g. with pandas' "
            "Categorical.set_categories, before writing)"
        )


def _describe_file(
    source: Source,
    file: StoredFile,
    tops: Sequence[str],
    start: int,
    specs: dict[str, TopInfo],
    first_file: dict[str, str],
    touched: dict[int, StoredFile],
    needed: set[int],
    kept: CatalogCache | None = None,
) -> FileInfo:
    """One file of the catalog, its rows from global index ``start`` (the file pinned): from
    ``kept`` where it holds the file as it is, else from h5py (and then kept)."""
    cached = kept.lookup(file, tops) if kept is not None else None
    described: dict[str, Described] = {}
    rows: dict[str, int] = {}
    elements: dict[str, int] = {}  # the stream's length, for a Windows top
    categories: dict[str, tuple[Any, ...]] = {}  # of the tops that are categorical groups
    layouts: dict[str, Layout] = {}
    h5: h5py.File | None = None
    ragged: dict[str, RaggedParts] = {}
    for top in tops:
        name = str(top)  # a plain name (a Windows top is one, saying how to cut it besides)
        found: FoundTop | None = None
        form: RaggedForm | None = None
        if cached is not None:
            stored_dtype, full_shape, layout = cached.tops[name]
            native = np.dtype(stored_dtype.newbyteorder("=").str)
            shape = full_shape[1:]
        else:
            if h5 is None:
                h5 = file.h5py_file()
                touched[id(file)] = file
            if not file.local:
                refuse_external_links(file.name, h5, name)
            coded = categorical(file.name, h5, name)
            if coded is not None:  # its codes are the rows; its names go to the catalog
                found = find_top(file.name, h5, coded[0])
                categories[name] = coded[1]
            else:
                form = find_form(file.name, h5, name)
                if form is None:
                    member_of_csr(file.name, h5, name)
                    found = find_top(file.name, h5, name)
            if form is None:
                assert found is not None
                native, shape = found.dtype, found.sample_shape
                full_shape = tuple(int(n) for n in found.dset.shape)
            else:
                native, shape = form.dtype, form.sample_shape
                full_shape = (form.nrows, *shape)
        windows = None
        nrows = full_shape[0]
        if isinstance(top, Windows):
            if form is not None:
                raise SchemaError(
                    f"{file.name}: top {top!r} cuts windows from a 1-D dataset, but {name!r} "
                    f"is stored as {_kind(form)}"
                )
            windows = (top.length, top.stride)
            if len(full_shape) != 1:
                raise SchemaError(
                    f"{file.name}: top {top!r} cuts windows from a 1-D dataset, but {name!r} "
                    f"has shape {full_shape}"
                )
            shape, nrows = (top.length,), count_windows(full_shape[0], top.length, top.stride)
            elements[name] = full_shape[0]
        spec = specs.get(name)
        if spec is None:
            info = None
            if form is not None:
                index = None if form.indices is None else form.indices.dtype.newbyteorder("=")
                info = RaggedInfo(
                    form.kind,
                    form.n_cols,
                    None if index is None else np.dtype(index.str),
                    vlen=form.vlen is not None,
                )
            specs[name] = TopInfo(name, np.dtype(native.str), shape, windows, info)
            first_file[name] = file.name
        elif (was := _kind(spec.ragged)) != (now := _kind(form)):
            raise SchemaError(
                f"{file.name}: top {name!r} is stored as {now}, but in {first_file[name]} as "
                f"{was}; a top must be stored alike in every file"
            )
        elif spec.sample_shape != shape or spec.dtype != native:
            raise SchemaError(
                f"{file.name}: top {name!r} has samples of shape {shape} and dtype {native}, "
                f"but {first_file[name]} has shape {spec.sample_shape} and dtype "
                f"{spec.dtype}; a top must have the same sample shape and dtype in every file"
            )
        rows[name] = nrows
        if form is not None:
            parts = _ragged_parts(source, file, form, name, touched, needed)
            ragged[name] = parts
            held = parts.vlen if parts.vlen is not None else parts.data
            assert held is not None
            layout = held
        elif found is not None:
            layout = _layout_of(source, file, found, name, touched, needed)
            if name not in categories:  # (the kept catalog does not hold category names)
                described[name] = (found.dset.dtype, full_shape, layout)
        layouts[name] = layout
    counts = set(rows.values())
    if len(counts) > 1:
        detail = ", ".join(f"{k!r}: {v} rows" for k, v in rows.items())
        cut = [t for t in tops if isinstance(t, Windows)]
        if cut:
            raise SchemaError(
                f"{file.name}: the tops have different row counts ({detail}); "
                + ", ".join(
                    f"{w!r} cuts {rows[str(w)]} windows from {elements[str(w)]} elements"
                    for w in cut
                )
                + ": every other top needs one row per window (row r is window r's sample)"
            )
        genes = [t for t in rows if t.lstrip("/").split("/", 1)[0] in ("var", "varm")]
        anndata = h5 is not None and _text(h5.attrs.get(ENCODING_ATTR)) == "anndata"
        raise SchemaError(
            f"{file.name}: the tops have different row counts ({detail}); row r of every "
            "top must be the same sample"
            + (
                f" ({', '.join(map(repr, genes))}: in an AnnData file, var and varm hold a row "
                "per gene, a column of X; obs, obsm, layers and X a row per cell)"
                if anndata and genes
                else ""
            )
        )
    if cached is not None:
        shuffled = cached.shuffled
    else:
        assert h5 is not None
        said = h5.attrs.get(SHUFFLED_ATTR)
        shuffled = isinstance(said, (bool, np.bool_)) and bool(said)
        if kept is not None and described and not ragged:  # ragged tops: described anew
            kept.record(file, described, shuffled)
    return FileInfo(file, counts.pop(), start, layouts, shuffled, categories, ragged)


def _kind(of: RaggedForm | RaggedInfo | None) -> str:
    """How a top found in a file (``RaggedForm``) or catalogued (``RaggedInfo``) is stored."""
    return "a dataset of fixed rows" if of is None else kind_words(of.kind, of.n_cols)


def _ragged_parts(
    source: Source,
    file: StoredFile,
    form: RaggedForm,
    name: str,
    touched: dict[int, StoredFile],
    needed: set[int],
) -> RaggedParts:
    """Where a ragged top's values are in ``file``: the layouts of its ``data`` (and
    ``indices``), each read as a dataset's rows are; a variable-length dataset through h5py."""
    if form.vlen is not None:
        holder, dset = physical(source, file, form.vlen)
        touched[id(holder)] = holder
        needed.add(id(holder))
        vlen = Layout(
            "h5py",
            "variable-length (h5py heap)",
            dataset_name=dset.name,
            file=holder,
            note="variable-length rows: HDF5 keeps their values in a heap that h5py reads",
        )
        return RaggedParts(form.indptr, vlen=vlen)

    def layout_of(dset: h5py.Dataset) -> Layout:
        dtype = np.dtype(dset.dtype.newbyteorder("=").str)
        found = FoundTop(dset, "", dtype, tuple(int(s) for s in dset.shape[1:]))
        return _layout_of(
            source, file, found, f"{name}/{posixpath.basename(dset.name)}", touched, needed
        )

    assert form.data is not None
    data = layout_of(form.data)
    indices = None if form.indices is None else layout_of(form.indices)
    return RaggedParts(form.indptr, data=data, indices=indices)


def _layout_of(
    source: Source,
    file: StoredFile,
    found: FoundTop,
    name: str,
    touched: dict[int, StoredFile],
    needed: set[int],
) -> Layout:
    """The layout of top ``name`` of ``file``, found as ``found`` (through h5py)."""
    holder, dset = physical(source, file, found.dset)
    with holder.pinned():  # an external link's target: not closed while described
        layout = describe_top(source, holder, dset, name, found.field)
    touched[id(holder)] = holder
    for dep in layout.depends:
        touched[id(dep)] = dep
    if layout.path == "h5py":
        needed.add(id(holder))
    return layout
