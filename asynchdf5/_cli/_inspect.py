"""``asynchdf5 inspect``: what the layer will find in a source, and how it will read it.

The analysis opens the files through the layer's own source seam and describes every top with
the layer's own layout code (:func:`asynchdf5._catalog.describe_top`, which the catalog calls),
so the read path shown is the one the layer takes; then it builds the catalog exactly as the
layer does (:func:`asynchdf5._catalog.build_catalog`), so a source the layer would refuse is
reported with the layer's own message. :mod:`._bench` reuses the analysis for its layout hints.
Without ``--tops``, a file that lacks the default tops is shown with what it offers as tops
(:func:`offer`), grouped by row count, the largest set analysed as above.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py

from .. import DataLayerError
from .._catalog import (
    ENCODING_ATTR,
    FoundTop,
    build_catalog,
    categorical,
    compound_field,
    describe_top,
    find_top,
    offered_tops,
    physical,
    refuse_external_links,
)
from .._codecs import FILTER_NAMES
from .._config import DEFAULT_TOPS, HDF5_PROPERTIES
from .._read import probe
from .._sizing import default_cache_bytes, heap_bytes, holds_whole
from .._sources import Source, name_entry, open_source, resolve_source
from .._windows import Windows, count_windows
from ._hints import PATH_WORDS, explain
from ._util import mib, plural, table, write_json

__all__ = [
    "FileReport",
    "Offer",
    "Report",
    "TopReport",
    "add_parser",
    "analyze",
    "offer",
    "render",
    "report_on",
]

#: The JSON document's format name and version (bumped when a field changes meaning).
FORMAT = "asynchdf5.inspect/1"


@dataclass
class TopReport:
    """One top of one file, as the layer will read it."""

    name: str
    rows: int | None = None
    sample_shape: tuple[int, ...] | None = None
    dtype: str | None = None
    bytes: int | None = None  # rows x sample bytes: what the layer delivers
    stored_bytes: int | None = None  # what the file stores (compressed size, when filtered)
    storage: str | None = None  # the layout's own words: "contiguous", "chunked (64, 3)", ...
    chunk_shape: tuple[int, ...] | None = None
    chunk_bytes: int | None = None
    filters: list[str] = field(default_factory=list)
    read_path: str | None = None  # "pread", "chunks" or "h5py"
    reason: str = ""
    hints: list[str] = field(default_factory=list)
    #: Those of ``hints`` about the copying reader's cost only: dropped when the source is mapped.
    copying_hints: set[str] = field(default_factory=set)
    stored_in: str | None = None  # another file, when an external link leads there
    error: str | None = None
    #: What the top is stored as (:func:`_form`): "rows", "windows", "categorical",
    #: "ragged", "sparse csr", "variable-length"; and what that means for reading it.
    form: str | None = None
    form_note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "sample_shape": None if self.sample_shape is None else list(self.sample_shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "storage": self.storage,
            "chunk_shape": None if self.chunk_shape is None else list(self.chunk_shape),
            "chunk_bytes": self.chunk_bytes,
            "filters": self.filters,
            "read_path": self.read_path,
            "reason": self.reason,
            "hints": self.hints,
            "stored_in": self.stored_in,
            "error": self.error,
            "form": self.form,
            "form_note": self.form_note,
        }


@dataclass
class FileReport:
    """One file of the source."""

    path: str
    tops: list[TopReport] = field(default_factory=list)
    error: str | None = None

    @property
    def samples(self) -> int | None:
        rows = {t.rows for t in self.tops}
        if self.error is not None or len(rows) != 1:
            return None
        return rows.pop()

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "samples": self.samples,
            "error": self.error,
            "tops": [t.to_json() for t in self.tops],
        }


@dataclass
class Offer:
    """What a file that lacks the default tops offers as tops, grouped by row count: only tops
    of one row count can be one layer's tops. ``sets`` go largest first (rows x columns: an
    AnnData file's ``X`` and ``obs`` columns before ``var``'s); the report's tops are the
    first set's, and its first file's table shows the other offered tops up to :data:`SHOWN`."""

    path: str
    source: str | list[str]
    sets: list[tuple[int, list[str]]] = field(default_factory=list)
    #: Offered tops not described in the table (beyond :data:`SHOWN`): how many.
    more: int = 0
    #: Objects that looked like tops but that the layer refuses: name and why.
    refused: list[tuple[str, str]] = field(default_factory=list)

    def layer_line(self) -> str:
        """The line a user pastes to open the largest set (a batch size of their choosing)."""
        tops = [repr(t) for t in self.sets[0][1]] if self.sets else []
        shown = ", ".join(tops) + ("," if len(tops) == 1 else "")
        return f"HDF5DataLayer({self.source!r}, tops=({shown}), batch_size=256)"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sets": [{"rows": rows, "tops": tops} for rows, tops in self.sets],
            "more": self.more,
            "refused": [{"name": name, "error": why} for name, why in self.refused],
            "layer": self.layer_line(),
        }


#: How many offered tops the table describes, and the sets list by name (the rest counted).
SHOWN = 12


@dataclass
class Report:
    """A source, file by file and top by top, with the layer's verdict."""

    source: str
    tops: tuple[str, ...]
    entries: list[str] = field(default_factory=list)
    files: list[FileReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: From the layer's catalog (empty when it refused the source): how each top is copied.
    read_paths: dict[str, str] = field(default_factory=dict)
    #: What the default, ``mmap="auto"``, does with the source now: ``"mapped: ..."`` (rows
    #: served from the page cache: the read path ``mmap``) or ``"copied: why"`` (the paths above).
    mmap: str | None = None
    samples: int | None = None
    #: Bytes of one sample over all tops, as a batch holds them; with a ragged or sparse top,
    #: on average (its values' bytes over the samples, and a row's offset), and ``varying``.
    sample_bytes: int | None = None
    varying: bool = False
    #: When inspect chose the tops itself (the file lacks the default ones): what it offers.
    offered: Offer | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def hints(self, tops: Collection[str] | None = None) -> list[str]:
        """Each distinct hint, prefixed by its top, in order (only ``tops``' when given: an
        offered report also describes tops beside its set)."""
        seen: dict[str, None] = {}
        for f in self.files:
            for t in f.tops:
                if tops is not None and t.name not in tops:
                    continue
                for h in t.hints:
                    seen.setdefault(f"{t.name}: {h}", None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "tops": list(self.tops),
            "ok": self.ok,
            "samples": self.samples,
            "sample_bytes": self.sample_bytes,
            "sample_bytes_vary": self.varying,
            "bytes": None
            if self.samples is None or self.sample_bytes is None
            else self.samples * self.sample_bytes,
            "read_paths": self.read_paths,
            "mmap": self.mmap,
            "files": [f.to_json() for f in self.files],
            "hints": self.hints(),
            "problems": self.problems,
            "offered": None if self.offered is None else self.offered.to_json(),
        }


def _filter_names(filters: Sequence[int]) -> list[str]:
    return [FILTER_NAMES.get(f, f"filter {f}") for f in filters]


# --- the analysis ------------------------------------------------------------------------------


def _top(source: Source, file: Any, name: str) -> TopReport:
    """One top of one open file (raises the layer's SourceError / SchemaError)."""
    h5 = file.h5py_file()
    if not file.local:
        refuse_external_links(file.name, h5, name)
    form, note, stored, rows = _form(file.name, h5, name)
    if form == "variable-length":  # not a top of rows h5py's layout code describes
        dset = h5[name]
        base = h5py.check_vlen_dtype(dset.dtype)
        return TopReport(
            name=name,
            rows=int(dset.shape[0]),
            dtype=str(base),
            # Its stored bytes are its rows' references (the values lie in HDF5's heap, of a
            # size h5py does not tell); its bytes come from the lengths the catalog reads.
            storage="variable-length (heap)",
            read_path="h5py",
            reason="each row is an object of HDF5's heap: only h5py reads it, row by row",
            form=form,
            form_note=note,
        )
    found = find_top(file.name, h5, stored)
    holder, dset = physical(source, file, found.dset)
    with holder.pinned():  # an external link's target: not closed while described
        # A group's stored rows are its values (data), a Windows top's the elements of its
        # stream, not its samples: the hints say so.
        unit = "element" if isinstance(name, Windows) else "sample" if rows is None else "value"
        t = _describe_top(source, holder, file, dset, found, name, unit)
    t.form, t.form_note = form, note
    if rows is not None:  # a group's samples are its rows, not its stored elements
        t.rows, t.sample_shape = rows, None  # bytes: its data's
    if isinstance(name, Windows):
        elements = int(dset.shape[0])
        t.rows = count_windows(elements, name.length, name.stride)
        t.sample_shape = (name.length,)
        t.bytes = t.rows * name.length * found.dtype.itemsize
    return t


def _form(file_name: str, h5: Any, name: str) -> tuple[str, str, str, int | None]:
    """What top ``name`` is stored as: its form, what that means for reading it, the dataset
    whose layout says how its bytes are read, and its rows when they are not that dataset's."""
    obj = h5.get(name)
    if isinstance(obj, h5py.Group):
        coded = categorical(file_name, h5, name)
        if coded is not None:
            names = coded[1]
            shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            return (
                "categorical",
                f"{len(names):,} categor{'y' if len(names) == 1 else 'ies'} ({shown}): the top "
                "is its "
                "integer codes, layer.categories[top] the names in code order",
                coded[0],
                None,
            )
        keys = set(obj.keys())
        said = obj.attrs.get(ENCODING_ATTR)
        said = said.decode() if isinstance(said, bytes) else said
        if {"data", "indptr"} <= keys and isinstance(obj.get("indptr"), h5py.Dataset):
            rows = max(0, int(obj["indptr"].shape[0]) - 1)
            stored = f"{name.rstrip('/')}/data"
            if "indices" in keys:
                shape = obj.attrs.get("shape")
                shown = "" if shape is None else f" of shape {tuple(int(n) for n in shape)}"
                kind = said if isinstance(said, str) else "CSR"
                return (
                    "sparse csr",
                    f"a sparse matrix{shown} ({kind}: data, indices, indptr): the rows of a "
                    "chunk are one contiguous range of data and of indices, found from indptr; "
                    "the read path below is data's",
                    stored,
                    rows,
                )
            return (
                "ragged",
                "variable-length rows (data + indptr: row r is data[indptr[r]:indptr[r+1]]): "
                "the rows of a chunk are one contiguous range of data, found from indptr; "
                "the read path below is data's",
                stored,
                rows,
            )
        return "group", "", name, None
    if isinstance(obj, h5py.Dataset) and "categories" in obj.attrs:
        coded = categorical(file_name, h5, name)
        if coded is not None:
            return (
                "categorical",
                f"{len(coded[1]):,} categories named by its `categories` reference (AnnData "
                "before 0.8): the top is its integer codes, layer.categories[top] the names",
                name,
                None,
            )
    vlen = isinstance(obj, h5py.Dataset) and h5py.check_vlen_dtype(obj.dtype) is not None
    if vlen and h5py.check_string_dtype(obj.dtype) is None:
        return (
            "variable-length",
            "an h5py variable-length dataset: each row is an object of HDF5's heap, read "
            "through h5py row by row (slow); `asynchdf5 pack FILE OUT_DIR --tops TOP ...` "
            "rewrites it as a ragged group (data + indptr), whose rows are read as "
            "contiguous ranges",
            name,
            None,
        )
    if isinstance(name, Windows):
        return (
            "windows",
            f"windows of {name.length} elements every {name.stride} from a 1-D stream: each "
            "run of consecutive windows (a shuffled chunk's blocks) is read as one contiguous "
            "range of the stream, then cut into rows of the cache"
            + (
                f" (overlapping: {name.length}/{name.stride} times the stream's bytes)"
                if name.stride < name.length
                else ""
            )
            + "; the read path below is the stream's, whose rows are its elements",
            name,
            None,
        )
    if isinstance(obj, h5py.Dataset) and obj.ndim == 1 and obj.dtype.kind in "iu":
        return "rows", _STREAM_NOTE, name, None
    return "rows", "", name, None


#: The note on a 1-D dataset of integers that `Windows` could cut (:func:`_tops` keeps it only
#: where no other top of the file has its rows).
_STREAM_NOTE = (
    "a 1-D stream of integers: Windows(top, length, stride) cuts fixed-length samples from it "
    "(a language model's tokens)"
)


def _describe_top(
    source: Source,
    holder: Any,
    file: Any,
    dset: Any,
    found: FoundTop,
    name: str,
    unit: str = "sample",
) -> TopReport:
    layout = describe_top(source, holder, dset, name, found.field)
    shape = found.sample_shape
    dtype = found.dtype
    row_bytes = dtype.itemsize * math.prod(shape)
    t = TopReport(
        name=name,
        rows=int(dset.shape[0]),
        sample_shape=shape,
        dtype=str(dtype),
        bytes=int(dset.shape[0]) * row_bytes,
        stored_bytes=int(dset.id.get_storage_size()),
        storage=layout.storage,
        filters=_filter_names(layout.filters),
        read_path=layout.path,
        stored_in=None if holder is file else holder.name,
    )
    if dset.chunks is not None:
        t.chunk_shape = tuple(int(c) for c in dset.chunks)
        t.chunk_bytes = dset.dtype.itemsize * math.prod(t.chunk_shape)  # whole records
    explain(t, layout, unit)
    return t


def _file(source: Source, entry: str, tops: Sequence[str]) -> FileReport:
    report = FileReport(entry)
    try:
        file = source.open(entry)
        with file.pinned():
            _tops(source, file, entry, tops, report)
    except DataLayerError as exc:
        name_entry(exc, entry)
        report.error = str(exc)
    return report


def _tops(source: Source, file: Any, entry: str, tops: Sequence[str], report: FileReport) -> None:
    file.h5py_file()
    for name in tops:
        try:
            report.tops.append(_top(source, file, name))
        except DataLayerError as exc:
            report.tops.append(TopReport(name, error=str(exc)))
        except (OSError, KeyError, ValueError) as exc:  # h5py on a damaged file
            report.tops.append(TopReport(name, error=f"{entry}: top {name!r}: {exc}"))
    # A 1-D integer top with as many rows as another top is a column of the samples (labels,
    # an AnnData obs column), not a token stream: pointing Windows out there misleads.
    for t in report.tops:
        if t.form_note == _STREAM_NOTE and any(
            o is not t and o.error is None and o.rows == t.rows for o in report.tops
        ):
            t.form_note = ""


def analyze(
    source: str | Sequence[str],
    tops: Sequence[str] = DEFAULT_TOPS,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Report:
    """Describe ``source`` file by file and top by top, and build the layer's catalog of it.

    Blocking (h5py): call it outside an event loop. Never raises the layer's errors: they are
    the report's ``problems``.
    """
    shown = source if isinstance(source, str) else ", ".join(source)
    report = Report(shown, tuple(tops))
    try:
        report.entries = resolve_source(source, storage_options=storage_options)
    except DataLayerError as exc:
        report.problems.append(str(exc))
        return report
    files = open_source(report.entries, storage_options=storage_options)
    try:
        report.files = [_file(files, e, tops) for e in report.entries]
    finally:
        files.close()
    for f in report.files:
        found = [f.error] if f.error else [t.error for t in f.tops if t.error]
        report.problems.extend(p for p in found if p and p not in report.problems)
    # The layer's verdict, from the layer's catalog, on a source of its own as the layer opens.
    files = open_source(report.entries, storage_options=storage_options)
    try:
        catalog = build_catalog(files, report.entries, tops)
    except DataLayerError as exc:
        if str(exc) not in report.problems:
            report.problems.append(str(exc))
    else:
        report.read_paths = catalog.read_paths()
        report.samples = catalog.n_samples
        report.varying = any(t.ragged is not None for t in catalog.tops.values())
        report.sample_bytes = catalog.mean_row_bytes if report.varying else catalog.row_bytes
        for f, info in zip(report.files, catalog.files, strict=True):
            for t in f.tops:
                parts = info.ragged.get(t.name)
                if t.form == "variable-length" and parts is not None:
                    t.bytes = int(parts.indptr[-1]) * catalog.tops[t.name].dtype.itemsize
        # Resident as the layer's default properties would cache it (its read_notes say
        # how the layer, with the user's cache_bytes, streams and ranks, does).
        n, heaps = catalog.n_samples, heap_bytes(catalog.tops)
        size = n * catalog.row_bytes + (heaps(n) if heaps else 0)
        chunk_size = HDF5_PROPERTIES["chunk_size"][1].default
        resident = holds_whole(n, size, chunk_size, default_cache_bytes())
        report.mmap = probe(catalog, resident=resident)  # takes the file's lease, gives it back
        if report.mmap.startswith("mapped"):  # the copying reader's costs are not paid
            for t in (t for f in report.files for t in f.tops):
                t.hints = [h for h in t.hints if h not in t.copying_hints]
    finally:
        files.close()
    return report


def _extent(file_name: str, h5: Any, name: str, words: str | None) -> tuple[int, int]:
    """Rows and columns (values per row) of an offered top, from its metadata alone."""
    field = compound_field(h5, name)
    if field is not None:  # a field of a compound dataset (a pandas table's column block)
        dset, field_name = field
        return int(dset.shape[0]), math.prod(dset.dtype.fields[field_name][0].shape)
    obj = h5[name]
    if words == "categorical":
        coded = categorical(file_name, h5, name)
        return (0, 0) if coded is None else (int(h5[coded[0]].shape[0]), 1)
    if words is not None:  # sparse CSR or ragged: data + indptr
        rows = max(0, int(obj["indptr"].shape[0]) - 1)
        shape = obj.attrs.get("shape")
        if words != "ragged" and shape is not None and len(shape) == 2:
            return rows, int(shape[1])
        return rows, int(obj["data"].shape[0]) // max(rows, 1)
    return int(obj.shape[0]), math.prod(int(n) for n in obj.shape[1:])


def offer(
    source: str | Sequence[str], *, storage_options: dict[str, Any] | None = None
) -> Report | None:
    """When the source's first file lacks a default top (an AnnData file, a file of unrelated
    datasets): the report of the largest set of tops it offers (:class:`Offer`), with the
    other offered tops described beside it. None when the file has the default tops, offers
    none, or cannot be opened: :func:`analyze` then reports why, in the layer's words.

    Blocking (h5py): call it outside an event loop.
    """
    try:
        entries = resolve_source(source, storage_options=storage_options)
    except DataLayerError:
        return None
    if not entries:
        return None
    files = open_source(entries[:1], storage_options=storage_options)
    try:
        file = files.open(entries[0])
        with file.pinned():
            h5 = file.h5py_file()
            if all(t in h5 for t in DEFAULT_TOPS):
                return None
            shown = source if isinstance(source, str) else list(source)
            found = Offer(entries[0], shown)
            extents: dict[str, tuple[int, int]] = {}
            for name, words in offered_tops(h5):
                try:
                    extents[name] = _extent(file.name, h5, name, words)
                except (DataLayerError, OSError, KeyError, ValueError, TypeError) as exc:
                    found.refused.append((name, str(exc)))
            described = _offered(files, file, entries[0], extents, found)
    except DataLayerError:
        return None
    finally:
        files.close()
    if not found.sets:
        return None
    report = analyze(source, found.sets[0][1], storage_options=storage_options)
    report.offered = found
    if report.files and report.files[0].error is None:
        report.files[0].tops += [t for t in described if t.name not in found.sets[0][1]]
    return report


def report_on(
    source: str | Sequence[str],
    tops: Sequence[str] | None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Report:
    """The report on ``tops``; without them (None), on the default tops, or, where the
    source's first file lacks those, on the largest set of tops it offers (:func:`offer`):
    every command that takes a source and defaults its tops chooses them here.

    Blocking (h5py): call it outside an event loop.
    """
    if tops is None:
        offered = offer(source, storage_options=storage_options)
        if offered is not None:
            return offered
    return analyze(source, DEFAULT_TOPS if tops is None else tops, storage_options=storage_options)


def _offered(
    source: Source, file: Any, entry: str, extents: dict[str, tuple[int, int]], found: Offer
) -> list[TopReport]:
    """Group the offered tops by rows into ``found.sets``, largest first, describing each
    (every one of the largest set, the others up to :data:`SHOWN`); a top the layer refuses
    leaves its set for ``found.refused``. The descriptions, in the sets' order."""
    by_rows: dict[int, list[str]] = {}
    for name, (rows, _) in extents.items():
        if rows > 0:
            by_rows.setdefault(rows, []).append(name)
    ranked = sorted(by_rows.items(), key=lambda s: -s[0] * sum(extents[n][1] for n in s[1]))
    described: list[TopReport] = []
    for rows, names in ranked:
        kept = []
        for name in names:
            if found.sets and len(described) >= SHOWN:
                found.more += 1
                kept.append(name)
                continue
            report = FileReport(entry)
            _tops(source, file, entry, [name], report)
            t = report.tops[0]
            if t.error is not None:
                found.refused.append((name, t.error))
                continue
            described.append(t)
            kept.append(name)
        if kept:
            found.sets.append((rows, kept))
    return described


# --- output ------------------------------------------------------------------------------------


def _cell(value: object) -> str:
    return "-" if value is None or value == [] else str(value)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(map(str, shape)) + ")"


def render(report: Report) -> str:
    """The report as text: a table per file, then why each top takes its read path, hints and
    problems."""
    out: list[str] = []
    head = f"source {report.source}: {plural(len(report.entries), 'file')}"
    if report.samples is not None and report.sample_bytes is not None:
        head += (
            f", {plural(report.samples, 'sample')} of "
            f"{'about ' if report.varying else ''}{report.sample_bytes:,} bytes"
            f"{' on average' if report.varying else ''} "
            f"({mib(report.samples * report.sample_bytes)})"
        )
    out.append(head + f"; tops {', '.join(report.tops)}")
    if report.offered is not None:
        out += _render_offer(report, report.offered)
    for f in report.files:
        out.append("")
        if f.error is not None:
            out.append(f"{f.path}: {f.error}")
            continue
        samples = f.samples if report.offered is None else report.samples  # the set's
        out.append(f"{f.path}: " + ("-" if samples is None else plural(samples, "sample")))
        rows = []
        for t in f.tops:
            if t.error is not None:
                rows.append([t.name, "error: see problems", "", "", "", "", "", "", ""])
                continue
            path = f"{PATH_WORDS.get(t.read_path or '', '-')} ({t.read_path})"
            stored = _cell(t.stored_bytes and mib(t.stored_bytes))
            rows.append(
                [
                    t.name,
                    f"{t.rows:,}",
                    _shape(t.sample_shape),
                    _cell(t.dtype),
                    mib(t.bytes or 0),
                    stored,
                    _cell(t.storage) + (f" in {t.stored_in}" if t.stored_in else ""),
                    ", ".join(t.filters) or "-",
                    path,
                ]
            )
        headers = ["top", "samples", "sample shape", "dtype", "bytes", "stored", "layout"]
        out.append(table([*headers, "filters", "read path"], rows))
    forms: dict[str, list[str]] = {}
    for f in report.files:
        for t in f.tops:
            if t.error is None and t.form is not None:
                line = t.form + (f": {t.form_note}" if t.form_note else "")
                if line not in forms.setdefault(t.name, []):
                    forms[t.name].append(line)
    if forms:
        out += ["", "forms (what each top is stored as):"]
        out += [f"  {top}: {line}" for top, lines in forms.items() for line in lines]
    reasons: dict[str, list[str]] = {}
    for f in report.files:
        for t in f.tops:
            if t.error is None and t.read_path is not None:
                line = f"{PATH_WORDS[t.read_path]} ({t.read_path}): {t.reason}"
                if line not in reasons.setdefault(t.name, []):
                    reasons[t.name].append(line)
    if reasons:
        out += ["", "read paths (as the layer will read each top):"]
        out += [f"  {top}: {line}" for top, lines in reasons.items() for line in lines]
    hints = report.hints()
    if hints:
        out += ["", "hints:"] + [f"  {h}" for h in hints]
    if report.problems:
        out += ["", f"problems ({len(report.problems)}), as the layer reports them:"]
        out += [f"  {p}" for p in report.problems]
        out += ["", "FAILED: the layer would refuse this source"]
    else:
        paths = ", ".join(f"{t} by {p}" for t, p in report.read_paths.items())
        if report.mmap is not None and report.mmap.startswith("mapped"):
            out += ["", f'OK: the layer maps the file (mmap="auto", the default): {report.mmap}']
            out += [f"    (with mmap=False it reads {paths})"]
        else:
            out += ["", f"OK: the layer reads {paths}"]
            if report.mmap is not None:
                out += [f'    (mmap="auto", the default: {report.mmap})']
    return "\n".join(out)


#: How many tops a line of the offered sets names (the rest counted).
_SET_AT_MOST = 12
#: How many of the offered sets (row counts) the text lists (the rest counted).
_SETS_AT_MOST = 8


def _render_offer(report: Report, found: Offer) -> list[str]:
    """The tops a file without the default ones offers, by row count, and the layer's line."""
    forms = {t.name: t.form for f in report.files[:1] for t in f.tops if t.form}
    count = sum(len(names) for _, names in found.sets)
    out = [
        "",
        f"{found.path} has no top {' or '.join(DEFAULT_TOPS)} (inspect's default; --tops names "
        f"others): it offers {plural(count, 'top')}, by row count (only tops of one row count "
        "are one layer's tops):",
    ]
    for rows, names in found.sets[:_SETS_AT_MOST]:
        named = [n + (f" ({forms[n]})" if forms.get(n, "rows") != "rows" else "") for n in names]
        more = len(named) - _SET_AT_MOST
        listed = ", ".join(named[:_SET_AT_MOST]) + (f", ... ({more} more)" if more > 0 else "")
        out.append(f"  tops with {plural(rows, 'row')}: {listed}")
    rest = found.sets[_SETS_AT_MOST:]
    if rest:
        tops = plural(sum(len(names) for _, names in rest), "top")
        out.append(f"  ... {plural(len(rest), 'other row count')} ({tops}; --json lists them)")
    if found.more:
        out.append(f"  ({plural(found.more, 'top')} not described below: --tops names them)")
    if found.refused:
        names = [name for name, _ in found.refused]
        more = len(names) - _SET_AT_MOST
        listed = ", ".join(names[:_SET_AT_MOST]) + (f", ... ({more} more)" if more > 0 else "")
        out.append(f"  refused as tops (--tops NAME says why): {listed}")
    out += ["the largest set, inspected below, opens as:", f"  {found.layer_line()}"]
    return out


# --- command line ------------------------------------------------------------------------------


def add_parser(commands: Any) -> None:
    """Register ``inspect`` with the command line's subcommands."""
    p = commands.add_parser(
        "inspect",
        help="show a source's files, tops and layouts, and how the layer will read them",
        description=(
            "For a source list file or HDF5 files: a table per file and per top (samples, "
            "sample shape, dtype, bytes, layout, filters) with the read path the layer will "
            "take (direct read, raw-chunk parallel decode, or the h5py fallback) and why, hints "
            "for slow layouts, and the problems the layer would refuse the source for, in the "
            "layer's own words. Exits 1 when there is a problem."
        ),
    )
    p.add_argument(
        "source",
        nargs="+",
        metavar="SOURCE",
        help="a source list file (one HDF5 path per line), or one or more HDF5 files",
    )
    p.add_argument(
        "--tops",
        nargs="+",
        metavar="TOP",
        help="the datasets to read, as the layer's `tops` (default: "
        f"{' '.join(DEFAULT_TOPS)}; where the file has no such top, what it offers as tops, "
        "grouped by row count, the largest set inspected)",
    )
    add_windows_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    p.set_defaults(run=run)


def add_windows_argument(p: argparse.ArgumentParser) -> None:
    """``--windows TOP:LENGTH[:STRIDE]...``, read back by :func:`named_tops`."""
    p.add_argument(
        "--windows",
        nargs="+",
        default=[],
        metavar="TOP:LENGTH[:STRIDE]",
        help="tops cut into fixed-length windows from a 1-D dataset, as the layer's "
        "Windows(TOP, LENGTH, STRIDE) (stride: LENGTH unless given)",
    )


def named_tops(args: argparse.Namespace) -> list[str] | None:
    """The tops ``--tops`` and ``--windows`` name (the windows first; ``--windows`` alone names
    them all), or None where neither is given: the defaults, or what the file offers. Raises
    ``argparse.ArgumentTypeError`` for a ``--windows`` that is not ``TOP:LENGTH[:STRIDE]``."""
    cut = [windows_top(w) for w in args.windows]
    named = {str(w) for w in cut}
    if args.tops is not None:
        return [*cut, *(t for t in args.tops if t not in named)]
    return list(cut) if cut else None


def windows_top(text: str) -> Windows:
    """``TOP:LENGTH[:STRIDE]`` as a :class:`~asynchdf5.Windows` top."""
    parts = text.rsplit(":", 2)
    try:
        if len(parts) == 3 and parts[1].isdigit():
            return Windows(parts[0], int(parts[1]), int(parts[2]))
        top, length = text.rsplit(":", 1)
        return Windows(top, int(length))
    except (ValueError, DataLayerError) as exc:
        raise argparse.ArgumentTypeError(
            f"--windows {text!r}: give TOP:LENGTH or TOP:LENGTH:STRIDE ({exc})"
        ) from exc


def run(args: argparse.Namespace) -> int:
    sources: list[str] = args.source
    source: str | list[str] = sources[0] if len(sources) == 1 else sources
    try:
        tops = named_tops(args)
    except argparse.ArgumentTypeError as exc:
        print(f"asynchdf5 inspect: error: {exc}", file=sys.stderr)
        return 2
    report = report_on(source, tops)
    if args.json:
        write_json(report.to_json())
    else:
        print(render(report))
    return 0 if report.ok else 1
