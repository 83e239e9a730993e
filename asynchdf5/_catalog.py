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
import math
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from ._catalog_cache import CatalogCache, Described
from ._errors import DataLayerError, SchemaError, SourceError
from ._layout import ChunkIndex, Extent, Layout, ReadPath, describe
from ._sources import LocalSource, Source, StoredFile, name_entry

__all__ = [
    "Catalog",
    "ChunkIndex",
    "Extent",
    "FileInfo",
    "Layout",
    "ReadPath",
    "Segment",
    "TopInfo",
    "build_catalog",
    "check_top",
    "physical",
    "refuse_external_links",
]

#: How many of a file's datasets a "top is missing" message lists.
_LIST_AT_MOST = 20


@dataclass(frozen=True)
class TopInfo:
    """A top: its name, the dtype of its samples (native byte order) and their shape."""

    name: str
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]
    #: Bytes of one sample (computed once: the chunk reader asks for it per byte range).
    row_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_bytes", self.dtype.itemsize * math.prod(self.sample_shape))


@dataclass(frozen=True, eq=False)
class FileInfo:
    """One file of the source: its row count, where its rows start, and each top's layout."""

    file: StoredFile
    nrows: int
    start: int  # global index of its row 0
    layouts: dict[str, Layout]

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
    n_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_samples = sum(f.nrows for f in self.files)
        # Files with rows only: 0-row files contribute nothing to the global index.
        self._nonempty = [f for f in self.files if f.nrows > 0]
        self._starts = [f.start for f in self._nonempty]

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample over all tops."""
        return sum(t.row_bytes for t in self.tops.values())

    def read_paths(self) -> dict[str, str]:
        """Read path of each top ("+"-joined when files differ)."""
        paths: dict[str, set[str]] = {t: set() for t in self.tops}
        for f in self._nonempty:
            for top, layout in f.layouts.items():
                paths[top].add(layout.path)
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


def _datasets(h5: h5py.File) -> list[str]:
    found: list[str] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            found.append("/" + name)

    h5.visititems(visit)
    return found


def _missing_top(name: str, h5: h5py.File, top: str) -> SchemaError:
    have = _datasets(h5)
    listed = ", ".join(repr(d) for d in have[:_LIST_AT_MOST])
    if len(have) > _LIST_AT_MOST:
        listed += f", ... ({len(have)} in all)"
    return SchemaError(
        f"{name}: top {top!r} is missing (no such dataset in the file); the file has "
        + (f"the datasets {listed}" if have else "no datasets")
    )


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
        raise _missing_top(name, h5, top)
    if not isinstance(obj, h5py.Dataset):
        raise SchemaError(f"{name}: top {top!r} is a {type(obj).__name__}, not a dataset")
    dt = obj.dtype
    if obj.shape is None or len(obj.shape) == 0:
        raise SchemaError(
            f"{name}: top {top!r} is a scalar (0-d) dataset; a top needs one row per sample"
        )
    if dt.names is not None:
        raise SchemaError(f"{name}: top {top!r} has a compound dtype {dt}; not supported")
    if h5py.check_vlen_dtype(dt) is not None or h5py.check_string_dtype(dt) is not None:
        raise SchemaError(
            f"{name}: top {top!r} holds strings or variable-length data ({dt}); not supported"
        )
    if dt.kind not in "biufc" or dt.subdtype is not None:
        raise SchemaError(
            f"{name}: top {top!r} has dtype {dt}; only bool, integer, float and complex are "
            "supported"
        )
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
    return Catalog(infos, specs)


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
    layouts: dict[str, Layout] = {}
    for name in tops:
        dset: h5py.Dataset | None = None
        if cached is not None:
            stored_dtype, full_shape, layout = cached[name]
        else:
            h5 = file.h5py_file()
            touched[id(file)] = file
            if not file.local:
                refuse_external_links(file.name, h5, name)
            dset = check_top(file.name, h5, name)
            stored_dtype, full_shape = dset.dtype, tuple(int(s) for s in dset.shape)
        native = stored_dtype.newbyteorder("=")
        shape = full_shape[1:]
        spec = specs.get(name)
        if spec is None:
            specs[name] = TopInfo(name, np.dtype(native.str), shape)
            first_file[name] = file.name
        elif spec.sample_shape != shape or spec.dtype != native:
            raise SchemaError(
                f"{file.name}: top {name!r} has samples of shape {shape} and dtype {native}, "
                f"but {first_file[name]} has shape {spec.sample_shape} and dtype "
                f"{spec.dtype}; a top must have the same sample shape and dtype in every file"
            )
        rows[name] = full_shape[0]
        if dset is not None:
            layout = _layout_of(source, file, dset, name, touched, needed)
            described[name] = (stored_dtype, full_shape, layout)
        layouts[name] = layout
    counts = set(rows.values())
    if len(counts) > 1:
        detail = ", ".join(f"{k!r}: {v} rows" for k, v in rows.items())
        raise SchemaError(
            f"{file.name}: the tops have different row counts ({detail}); row r of every "
            "top must be the same sample"
        )
    if kept is not None and described:
        kept.record(file, described)
    return FileInfo(file, counts.pop(), start, layouts)


def _layout_of(
    source: Source,
    file: StoredFile,
    dset: h5py.Dataset,
    name: str,
    touched: dict[int, StoredFile],
    needed: set[int],
) -> Layout:
    """The layout of top ``name`` of ``file``, stored as ``dset`` (through h5py)."""
    holder, dset = physical(source, file, dset)
    with holder.pinned():  # an external link's target: not closed while described
        layout = describe(source, holder, dset, name)
    touched[id(holder)] = holder
    for dep in layout.depends:
        touched[id(dep)] = dep
    if layout.path == "h5py":
        needed.add(id(holder))
    return layout
