"""Catalog: the files of a source, their tops, shapes, dtypes and storage layout.

Built once when a layer is opened, in a worker thread (h5py is only ever called off the event loop).
It records what the reader needs to read rows without asking h5py again: for each file and top the
storage layout and, for contiguous data, the byte offset of row 0. The catalog maps the global
index (files concatenated in source order) to file rows.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np

from ._codecs import unsupported_filters
from ._errors import SchemaError, SourceError
from ._source import is_hdf5_file

__all__ = [
    "Catalog",
    "ChunkIndex",
    "FileInfo",
    "Layout",
    "Segment",
    "TopInfo",
    "build_catalog",
]

LayoutKind = Literal["contiguous", "chunked", "other"]


@dataclass(frozen=True)
class TopInfo:
    """A top: its name, the dtype of its samples (native byte order) and their shape."""

    name: str
    dtype: np.dtype[Any]
    sample_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample."""
        return int(self.dtype.itemsize * int(np.prod(self.sample_shape, dtype=np.int64)))


@dataclass(frozen=True, eq=False)
class Layout:
    """How one top is stored in one file, and so which read path it takes.

    * ``offset`` (path ``pread``): the byte offset of row 0 when the rows can be read straight
      from the file with ``os.preadv`` (contiguous, allocated, no external storage, native dtype).
    * ``chunks`` (path ``chunks``): for data chunked along the rows only, with every chunk
      allocated and a filter pipeline that :mod:`._codecs` decodes: the byte offset, stored size
      and filter mask of each chunk, by chunk number; ``chunk_rows`` rows per chunk.
    * neither (path ``h5py``): h5py reads it, holding its lock.
    """

    kind: LayoutKind
    offset: int | None = None
    chunk_rows: int | None = None
    filters: tuple[int, ...] = ()
    chunks: ChunkIndex | None = None
    note: str = ""  # why the h5py fallback is taken

    @property
    def path(self) -> str:
        if self.offset is not None:
            return "pread"
        if self.chunks is not None:
            return "chunks"
        return "h5py"


@dataclass(frozen=True, eq=False)
class ChunkIndex:
    """Where a dataset's chunks are stored: arrays indexed by chunk number along the rows."""

    offsets: np.ndarray  # int64 byte offsets
    sizes: np.ndarray  # int64 stored sizes
    masks: np.ndarray  # uint32 filter masks


@dataclass(frozen=True)
class FileInfo:
    """One file of the source: its path, identity, row count and the layout of each top."""

    path: Path
    nrows: int
    start: int  # global index of its row 0
    layouts: dict[str, Layout]
    identity: tuple[int, int, int, int]  # (st_dev, st_ino, st_size, st_mtime_ns) when catalogued


@dataclass(frozen=True)
class Segment:
    """Rows ``row_start:row_stop`` of file ``file``, landing at ``out_start`` of a chunk."""

    file: FileInfo
    row_start: int
    row_stop: int
    out_start: int


class Catalog:
    """Files and tops of a source; maps global index ranges to file segments."""

    def __init__(self, files: Sequence[FileInfo], tops: dict[str, TopInfo]) -> None:
        self.files = list(files)
        self.tops = tops
        self.n_samples = sum(f.nrows for f in self.files)
        # Files with rows only: 0-row files contribute nothing to the global index.
        self._nonempty = [f for f in self.files if f.nrows > 0]
        self._starts = [f.start for f in self._nonempty]

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample over all tops."""
        return sum(t.row_bytes for t in self.tops.values())

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


def _check_top(path: Path, name: str, obj: object) -> h5py.Dataset:
    if obj is None:
        raise SchemaError(f"{path}: top {name!r} is missing (no such dataset in the file)")
    if not isinstance(obj, h5py.Dataset):
        raise SchemaError(f"{path}: top {name!r} is a {type(obj).__name__}, not a dataset")
    dt = obj.dtype
    if obj.shape is None or len(obj.shape) == 0:
        raise SchemaError(
            f"{path}: top {name!r} is a scalar (0-d) dataset; a top needs one row per sample"
        )
    if dt.names is not None:
        raise SchemaError(f"{path}: top {name!r} has a compound dtype {dt}; not supported")
    if h5py.check_vlen_dtype(dt) is not None or h5py.check_string_dtype(dt) is not None:
        raise SchemaError(
            f"{path}: top {name!r} holds strings or variable-length data ({dt}); not supported"
        )
    if dt.kind not in "biufc" or dt.subdtype is not None:
        raise SchemaError(
            f"{path}: top {name!r} has dtype {dt}; only bool, integer, float and complex are "
            "supported"
        )
    return obj


def _chunk_index(dset: h5py.Dataset, nchunks: int) -> ChunkIndex | None:
    offsets = np.full(nchunks, -1, np.int64)
    sizes = np.zeros(nchunks, np.int64)
    masks = np.zeros(nchunks, np.uint32)
    rows = dset.chunks[0]

    def visit(info: Any) -> None:
        k = info.chunk_offset[0] // rows
        offsets[k], sizes[k], masks[k] = info.byte_offset, info.size, info.filter_mask

    dsid = dset.id
    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(visit)
    else:  # pragma: no cover - HDF5 < 1.12.3
        for i in range(dsid.get_num_chunks()):
            visit(dsid.get_chunk_info(i))
    if (offsets < 0).any():
        return None  # some chunks were never written: h5py supplies the fill value
    return ChunkIndex(offsets, sizes, masks)


def _layout(dset: h5py.Dataset, native: np.dtype[Any]) -> Layout:
    plist = dset.id.get_create_plist()
    kind = plist.get_layout()
    external = plist.get_external_count() > 0
    if kind == h5py.h5d.CONTIGUOUS:
        offset = dset.id.get_offset()
        direct = offset is not None and not external and dset.dtype == native and dset.shape[0] > 0
        return Layout(
            "contiguous",
            offset if direct else None,
            note="" if direct else "unallocated, external or non-native byte order",
        )
    if kind != h5py.h5d.CHUNKED:
        return Layout("other", note="compact or virtual layout")
    chunks = dset.chunks
    filters = tuple(plist.get_filter(i)[0] for i in range(plist.get_nfilters()))
    layout = Layout("chunked", None, chunks[0], filters)
    if dset.dtype != native:
        return replace(layout, note="non-native byte order")
    if tuple(chunks[1:]) != tuple(dset.shape[1:]):
        return replace(layout, note=f"chunks {chunks} split the samples")
    missing = unsupported_filters(filters)
    if missing:
        return replace(layout, note=f"no GIL-free decoder for {', '.join(missing)}")
    nchunks = -(-dset.shape[0] // chunks[0])
    index = _chunk_index(dset, nchunks) if nchunks else None
    if index is None:
        return replace(layout, note="chunks not all allocated (fill values)")
    return replace(layout, chunks=index)


def _open(path: Path) -> h5py.File:
    if not path.exists():
        raise SourceError(f"HDF5 file {str(path)!r} (named in the source) does not exist")
    if path.is_dir():
        raise SourceError(f"{str(path)!r} (named in the source) is a directory, not an HDF5 file")
    if not os.access(path, os.R_OK):
        raise SourceError(f"HDF5 file {str(path)!r} is not readable (permission denied)")
    try:
        if not is_hdf5_file(path):
            raise SourceError(f"{str(path)!r} (named in the source) is not an HDF5 file")
        return h5py.File(path, "r")
    except SourceError:
        raise
    except OSError as exc:
        raise SourceError(f"cannot open HDF5 file {str(path)!r}: {exc}") from exc


def build_catalog(paths: Sequence[Path], tops: Sequence[str]) -> Catalog:
    """Open every file once, check the tops and record their layout. Blocking: run in a thread."""
    infos: list[FileInfo] = []
    specs: dict[str, TopInfo] = {}
    first_file: dict[str, Path] = {}
    start = 0
    for path in paths:
        with _open(path) as f:
            rows: dict[str, int] = {}
            layouts: dict[str, Layout] = {}
            for name in tops:
                dset = _check_top(path, name, f.get(name))
                native = dset.dtype.newbyteorder("=")
                shape = tuple(int(s) for s in dset.shape[1:])
                spec = specs.get(name)
                if spec is None:
                    specs[name] = TopInfo(name, native, shape)
                    first_file[name] = path
                elif spec.sample_shape != shape or spec.dtype != native:
                    raise SchemaError(
                        f"{path}: top {name!r} has samples of shape {shape} and dtype {native}, "
                        f"but {first_file[name]} has shape {spec.sample_shape} and dtype "
                        f"{spec.dtype}; a top must have the same sample shape and dtype in every "
                        "file"
                    )
                rows[name] = int(dset.shape[0])
                layouts[name] = _layout(dset, native)
            counts = set(rows.values())
            if len(counts) > 1:
                detail = ", ".join(f"{k!r}: {v}" for k, v in rows.items())
                raise SchemaError(
                    f"{path}: the tops have different row counts ({detail}); row r of every top "
                    "must be the same sample"
                )
            st = os.stat(path)
            nrows = counts.pop()
            infos.append(
                FileInfo(
                    path,
                    nrows,
                    start,
                    layouts,
                    (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns),
                )
            )
            start += nrows
    if start == 0:
        raise SourceError(
            f"the source's {len(infos)} file(s) hold no samples (every top has 0 rows)"
        )
    return Catalog(infos, specs)
