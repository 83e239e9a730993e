"""Storage layouts: exactly where the bytes of one top of one file are, so the reader never guesses.

Read from h5py's metadata when the catalog is built (:func:`describe`). A layout takes a fast
path only when every byte of it is accounted for:

* ``pread``: data stored contiguously as exactly the numpy dtype's bytes (in either byte order):
  in the file itself, in the target file of an external link, or in external raw files (each
  checked to exist and to hold the bytes: HDF5 would read zeros in place of missing ones).
  A dataset of no rows (shape ``(0, ...)``: a ragged or sparse top's heap of no values) is
  ``pread`` with no extent, or ``chunks`` with no chunk, whatever HDF5 allocated: nothing to read.
* ``chunks``: chunked, every chunk written (its place taken from HDF5's own chunk index at open,
  never computed), with no filters or a filter pipeline that :mod:`._codecs` decodes (fletcher32
  verified). Chunks may split the samples: a *band* (every chunk of one run of rows) then holds
  whole samples. Partial edge chunks stored unfiltered (``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``,
  which h5py does not expose: read from the libhdf5 that h5py loaded, through ctypes) are read as
  stored; unfiltered chunks must each be stored at exactly the chunk's size.
* ``h5py``: everything else (compact and virtual layouts, filters without a GIL-free decoder,
  types stored with another precision or padding, unwritten chunks),
  with the files that HDF5 opens by name listed so that the reader can check them after each
  read; a virtual dataset whose source is missing or short is refused
  (:class:`~asynchdf5.SourceError`): HDF5 would read fill values in its place.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import h5py
import numpy as np

from ._codecs import unsupported_filters
from ._errors import SourceError
from ._sources import Source, StoredFile

__all__ = ["ChunkIndex", "Extent", "Layout", "ReadPath", "describe"]

ReadPath = Literal["pread", "chunks", "h5py"]
#: ``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS`` (H5Dpublic.h): partial edge chunks stored unfiltered.
_DONT_FILTER_PARTIAL_CHUNKS = 0x0002


@dataclass(frozen=True, eq=False)
class Extent:
    """Bytes ``start:start + size`` of a dataset's data, stored at ``offset`` of ``file``."""

    file: StoredFile
    offset: int
    start: int
    size: int


@dataclass(frozen=True, eq=False)
class ChunkIndex:
    """Where a dataset's chunks are stored, as HDF5's chunk index says.

    The arrays are indexed ``[k, j]``: ``k`` the chunk's number along the rows, ``j`` its number
    within the band of row chunk ``k`` (the chunks covering its rows, in C order over the other
    dimensions; a single one where chunks hold whole samples).
    """

    file: StoredFile
    rows: int  # rows per chunk
    offsets: np.ndarray  # int64 byte offsets, (row chunks, band)
    sizes: np.ndarray  # int64 stored sizes
    #: uint32 filter masks (bit i set: filter i was skipped for that chunk, or every bit for a
    #: partial edge chunk stored unfiltered under DONT_FILTER_PARTIAL_CHUNKS).
    masks: np.ndarray
    #: The chunk's shape (its first dimension is ``rows``).
    shape: tuple[int, ...] = ()
    #: The dataset's sample shape (the chunks of a band tile it, the edge ones cut).
    sample_shape: tuple[int, ...] = ()

    @property
    def band(self) -> int:
        """Chunks per run of ``rows`` rows (1: each chunk holds whole samples)."""
        return int(self.offsets.shape[1])

    @property
    def splits_samples(self) -> bool:
        """Whether a chunk holds only part of each of its samples."""
        return tuple(self.shape[1:]) != tuple(self.sample_shape)


@dataclass(frozen=True, eq=False)
class Layout:
    """How one top is stored in one file, and so which read path it takes.

    ``swap``: stored in the other byte order (swapped in place after a fast read). For the
    ``h5py`` path: ``dataset_name`` is the dataset to read in ``file``, the file holding it
    (:meth:`open_dataset`), and ``depends`` the files whose bytes that read uses besides
    (external raw files, virtual sources), which HDF5 opens by name; all are checked after
    every read.
    """

    path: ReadPath
    storage: str  # what `inspect` and the log show: "contiguous", "chunked (100, 3)", ...
    filters: tuple[int, ...] = ()
    swap: bool = False
    extents: tuple[Extent, ...] = ()
    chunks: ChunkIndex | None = None
    dataset_name: str = ""
    file: StoredFile | None = None
    depends: tuple[StoredFile, ...] = ()
    note: str = ""  # why the h5py path is taken
    #: The field of a compound dataset this top is (the h5py path reads it out of the records).
    field: str = ""

    def open_dataset(self) -> Any:
        """The h5py dataset to read (blocking; the h5py path): call it, and use what it returns,
        while ``file`` is pinned. Looked up again each time: a local source may close the file's
        h5py handle between reads, and every dataset of it with it."""
        assert self.file is not None
        return self.file.h5py_file()[self.dataset_name]


def _stored_as_numpy(dset: h5py.Dataset) -> bool:
    """Whether the stored type is exactly the standard type of the dataset's numpy dtype, so its
    bytes can be used without conversion (not, e.g., a 20-bit integer in 4 bytes)."""
    ftype = dset.id.get_type()
    plain = np.dtype(dset.dtype.str)  # without h5py's enum metadata
    try:
        if ftype.equal(h5py.h5t.py_create(dset.dtype)):
            return True
        # Enum values are stored as their base integers.
        return bool(
            ftype.get_class() == h5py.h5t.ENUM
            and plain.kind in "iu"
            and ftype.get_super().equal(h5py.h5t.py_create(plain))
        )
    except (TypeError, ValueError):
        return False


# --- the libhdf5 that h5py uses, for what h5py does not wrap -----------------------------------


@functools.cache
def _get_chunk_opts() -> Callable[[int], int | None] | None:
    """``H5Pget_chunk_opts`` of the libhdf5 h5py is linked to, or None where it is not exported.

    The symbol is looked up through h5py's own extension module: the dynamic linker searches
    that module and the libraries it was linked with, so another libhdf5 in the process (PyTables
    brings its own) is never asked about h5py's identifiers, whose numbers it may also use.
    """
    try:
        fn = ctypes.CDLL(h5py.defs.__file__).H5Pget_chunk_opts
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint)]
    fn.restype = ctypes.c_int

    def get(plist_id: int) -> int | None:
        opts = ctypes.c_uint(0)
        return int(opts.value) if fn(plist_id, ctypes.byref(opts)) >= 0 else None

    return get


def _chunk_opts(plist: Any) -> int | None:
    get = _get_chunk_opts()
    return None if get is None else get(plist.id)


# --- layouts -----------------------------------------------------------------------------------


def _prefixed(name: str, owner: str, prefix: str | bytes | None, env: str) -> str | None:
    """``name`` under an HDF5 prefix property or environment variable (``${ORIGIN}``: the
    folder of ``owner``), or None when neither is set."""
    if isinstance(prefix, bytes):
        prefix = prefix.decode()
    prefix = prefix or os.environ.get(env) or ""
    if not prefix:
        return None
    if prefix.startswith("${ORIGIN}"):
        prefix = os.path.dirname(owner) + prefix[len("${ORIGIN}") :]
    return os.path.join(prefix, name)


def _external_extents(
    source: Source, file: StoredFile, dset: h5py.Dataset, top: str, nbytes: int
) -> tuple[Extent, ...]:
    """The external raw files of ``dset`` (``H5Pset_external``), each checked to hold the bytes
    the dataset needs: HDF5 would read zeros past the end of a short or missing one."""
    plist = dset.id.get_create_plist()
    prefix = dset.id.get_access_plist().get_efile_prefix()
    extents = []
    start = 0
    for i in range(plist.get_external_count()):
        if start >= nbytes:
            break
        raw_name, offset, size = plist.get_external(i)
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        if not os.path.isabs(name):  # as HDF5 does: a prefix, else the working directory
            name = _prefixed(name, file.name, prefix, "HDF5_EXTFILE_PREFIX") or os.path.abspath(
                name
            )
        used = min(size, nbytes - start)
        if not source.exists(name):
            raise SourceError(
                f"{file.name}: top {top!r} keeps its data in the external file {name!r}, which "
                "does not exist (HDF5 would read zeros in its place)"
            )
        ext = source.open(name, hdf5=False)
        if ext.size < offset + used:
            raise SourceError(
                f"{file.name}: top {top!r} keeps bytes {start}:{start + used} of its data in the "
                f"external file {name!r} from offset {offset}, but that file has only {ext.size} "
                "bytes (HDF5 would read zeros in place of the rest)"
            )
        extents.append(Extent(ext, int(offset), start, int(used)))
        start += used
    if start < nbytes:
        raise SourceError(
            f"{file.name}: top {top!r} needs {nbytes} bytes of external storage, its external "
            f"files hold {start}"
        )
    return tuple(extents)


def _virtual_sources(
    source: Source, file: StoredFile, dset: h5py.Dataset, top: str
) -> tuple[StoredFile, ...]:
    """The source files of a virtual dataset, each checked to exist and to hold the rows mapped
    from it: HDF5 reads fill values where a source is missing or short."""
    plist = dset.id.get_create_plist()
    prefix = dset.id.get_access_plist().get_virtual_prefix()
    depends: dict[str, StoredFile] = {}
    for i in range(plist.get_virtual_count()):
        fname = plist.get_virtual_filename(i)
        dname = plist.get_virtual_dsetname(i)
        where = f"{file.name}: top {top!r} is a virtual dataset whose mapping {i}"
        if "%" in fname or "%" in dname:
            raise SourceError(
                f"{where} names its sources with a printf-style pattern ({fname!r}, {dname!r}), "
                "which cannot be checked for missing sources: write a virtual dataset with "
                "explicit source names, or copy the data into a plain dataset"
            )
        if fname == ".":
            stored = file
        else:
            candidates = [fname] if os.path.isabs(fname) else []
            if not candidates:
                pre = _prefixed(fname, file.name, prefix, "HDF5_VDS_PREFIX")
                candidates = [c for c in (pre,) if c is not None]
                candidates += [os.path.join(os.path.dirname(file.name), fname)]
                candidates += [os.path.abspath(fname)]
            name = next((c for c in candidates if source.exists(c)), None)
            if name is None:
                raise SourceError(
                    f"{where} reads from {fname!r}, which does not exist (HDF5 would read fill "
                    "values in place of its rows)"
                )
            stored = depends.get(name) or source.open(name)
        src = stored.h5py_file().get(dname)
        if not isinstance(src, h5py.Dataset):
            raise SourceError(
                f"{where} reads dataset {dname!r} of {stored.name!r}, which has no such dataset "
                "(HDF5 would read fill values in place of its rows)"
            )
        space = plist.get_virtual_srcspace(i)
        if space.get_select_type() == h5py.h5s.SEL_ALL:  # the whole source, as many elements
            need = plist.get_virtual_vspace(i).get_select_npoints()
            if src.size < need:
                raise SourceError(
                    f"{where} maps {need} elements from {dname!r} in {stored.name!r}, which has "
                    f"only {src.size} (shape {src.shape}; HDF5 would read fill values for the rest)"
                )
        elif space.get_select_type() != h5py.h5s.SEL_NONE:
            _, end = space.get_select_bounds()
            if any(e >= n for e, n in zip(end, src.shape, strict=False)):
                raise SourceError(
                    f"{where} reads up to index {tuple(end)} of {dname!r} in {stored.name!r}, "
                    f"which has shape {src.shape} (HDF5 would read fill values beyond it)"
                )
        if stored is not file:
            depends[stored.name] = stored
    return tuple(depends.values())


def _refuse_names(file: StoredFile, top: str, what: str) -> None:
    """Stored names are local paths to HDF5: in a remote file they would name local files,
    never what the file means, so such layouts are refused there."""
    if not file.local:
        raise SourceError(
            f"{file.name}: top {top!r} {what}; external storage, virtual datasets and external "
            "links in remote files are not supported: HDF5 would look the files they name up "
            "on the local file system. Copy the data into the file (h5repack) before uploading it"
        )


def _h5py(storage: str, file: StoredFile, dset: h5py.Dataset, note: str, **kw: Any) -> Layout:
    return Layout("h5py", storage, dataset_name=dset.name, file=file, note=note, **kw)


def describe(source: Source, file: StoredFile, dset: h5py.Dataset, top: str) -> Layout:
    """The layout of top ``top`` of ``file``, stored as ``dset`` (blocking: h5py calls)."""
    plist = dset.id.get_create_plist()
    kind = plist.get_layout()
    nrows = int(dset.shape[0])
    row_bytes = dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64))
    nbytes = nrows * row_bytes
    exact = _stored_as_numpy(dset)
    swap = not dset.dtype.isnative and dset.dtype.itemsize > 1
    if kind == h5py.h5d.VIRTUAL:
        _refuse_names(file, top, "is a virtual dataset")
        depends = _virtual_sources(source, file, dset, top)
        return _h5py("virtual", file, dset, "virtual dataset", depends=depends)
    if kind == h5py.h5d.COMPACT:
        return _h5py("compact", file, dset, "compact layout")
    if kind == h5py.h5d.CONTIGUOUS:
        if plist.get_external_count() > 0:
            _refuse_names(file, top, "keeps its data in external raw files")
            extents = _external_extents(source, file, dset, top, nbytes)
            files = tuple({id(e.file): e.file for e in extents}.values())
            storage = f"external ({len(files)} file{'s' if len(files) != 1 else ''})"
            if not exact:
                return _h5py(storage, file, dset, "stored type needs conversion", depends=files)
            return Layout("pread", storage, swap=swap, extents=extents)
        if nbytes == 0:  # shape (0, ...) or rows of no bytes: none to read, none to account for
            return Layout("pread", "contiguous", swap=swap)
        offset = dset.id.get_offset()
        if offset is None or nbytes == 0:  # never written: HDF5 supplies the fill value
            return _h5py("contiguous", file, dset, "not allocated (fill values)")
        if not exact:
            return _h5py("contiguous", file, dset, "stored type needs conversion")
        if offset + nbytes > file.size:
            raise SourceError(
                f"{file.name}: top {top!r} is stored at bytes {offset}:{offset + nbytes}, beyond "
                f"the end of the file ({file.size} bytes): the file is truncated"
            )
        return Layout("pread", "contiguous", swap=swap, extents=(Extent(file, offset, 0, nbytes),))
    # Chunked.
    chunks = tuple(int(c) for c in dset.chunks)
    filters = tuple(plist.get_filter(i)[0] for i in range(plist.get_nfilters()))
    storage = f"chunked {chunks}"
    if not exact:
        return _h5py(storage, file, dset, "stored type needs conversion", filters=filters)
    missing = unsupported_filters(filters)
    if missing:
        note = f"no GIL-free decoder for {', '.join(missing)}"
        return _h5py(storage, file, dset, note, filters=filters)
    shape = tuple(int(n) for n in dset.shape)
    partial = any(n % c for n, c in zip(shape, chunks, strict=True))
    raw_partial = False
    if filters and partial:
        opts = _chunk_opts(plist)
        if opts is None:
            note = "cannot tell whether partial edge chunks are filtered (libhdf5 not found)"
            return _h5py(storage, file, dset, note, filters=filters)
        raw_partial = bool(opts & _DONT_FILTER_PARTIAL_CHUNKS)
    # Shape (0, ...): no chunk in the extent, so an empty index (nothing to read).
    index = _chunk_index(file, dset, shape, chunks, len(filters), raw_partial)
    if index is None:
        note = "chunks not all written (fill values)"
        return _h5py(storage, file, dset, note, filters=filters)
    if not filters:
        chunk_bytes = dset.dtype.itemsize * int(np.prod(chunks, dtype=np.int64))
        if index.sizes.size and (index.sizes != chunk_bytes).any():
            note = f"unfiltered chunks not stored at their size ({chunk_bytes} bytes)"
            return _h5py(storage, file, dset, note, filters=filters)
    end = int((index.offsets + index.sizes).max()) if index.offsets.size else 0
    if end > file.size:
        raise SourceError(
            f"{file.name}: top {top!r} has chunks stored up to byte {end}, beyond the end of the "
            f"file ({file.size} bytes): the file is truncated"
        )
    return Layout("chunks", storage, filters=filters, swap=swap, chunks=index)


def _chunk_index(
    file: StoredFile,
    dset: h5py.Dataset,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    nfilters: int,
    raw_partial: bool,
) -> ChunkIndex | None:
    """Every chunk's place, from HDF5's chunk index (``chunk_iter``); None when some chunk of the
    extent was never written (h5py supplies the fill value there)."""
    grid = tuple(-(-n // c) for n, c in zip(shape, chunks, strict=True))
    band = int(np.prod(grid[1:], dtype=np.int64))
    offsets = np.full((grid[0], band), -1, np.int64)
    sizes = np.zeros((grid[0], band), np.int64)
    masks = np.zeros((grid[0], band), np.uint32)

    # HDF5's answers gathered first, placed at once: a split data set has tens of thousands of
    # chunks, and numpy calls per chunk would cost tens of microseconds each, at every opening.
    infos: list[Any] = []
    dsid = dset.id
    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(infos.append)
    else:  # pragma: no cover - HDF5 < 1.12.3
        infos = [dsid.get_chunk_info(i) for i in range(dsid.get_num_chunks())]
    if infos:
        n = len(infos)
        at = np.array([i.chunk_offset for i in infos], np.int64).reshape(n, len(chunks))
        at //= np.array(chunks, np.int64)
        inside = (at < np.array(grid, np.int64)).all(axis=1)  # beyond the extent: not data
        at = at[inside]
        j = np.ravel_multi_index(tuple(at[:, 1:].T), grid[1:]) if len(chunks) > 1 else 0
        k = at[:, 0]
        offsets[k, j] = np.fromiter((i.byte_offset for i in infos), np.int64, n)[inside]
        sizes[k, j] = np.fromiter((i.size for i in infos), np.int64, n)[inside]
        masks[k, j] = np.fromiter((i.filter_mask for i in infos), np.uint32, n)[inside]
    if (offsets < 0).any():
        return None  # some chunks were never written: h5py supplies the fill value
    if raw_partial:  # partial edge chunks are stored as they are: every filter skipped
        every = np.uint32((1 << nfilters) - 1)
        if shape[0] % chunks[0]:
            masks[-1, :] = every
        edges = np.zeros(grid[1:], bool)
        for d, (n, c) in enumerate(zip(shape[1:], chunks[1:], strict=True)):
            if n % c:
                edges[(slice(None),) * d + (-1,)] = True
        masks[:, edges.reshape(-1)] = every
    return ChunkIndex(file, chunks[0], offsets, sizes, masks, chunks, shape[1:])
