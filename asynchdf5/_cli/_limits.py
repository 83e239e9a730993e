"""The limits a loader is measured against: the raw read of the stored bytes and the in-RAM
ceiling (blocking code, run outside any event loop).

``asynchdf5 bench`` runs them on the user's files; the benchmark suite's baselines
(``benchmarks/baselines.py``) run the same two loops, :func:`read_ranges` and
:func:`gather_epoch`, on its data sets, over the same stored ranges (:func:`stored_ranges`):
one definition of each limit."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .._catalog import Catalog, FileInfo, build_catalog, categorical, compound_field
from .._fileio import pread_into
from .._layout import Layout
from .._sources import LocalSource

__all__ = [
    "READ_BYTES",
    "Rate",
    "gather_epoch",
    "in_ram",
    "raw_read",
    "read_ranges",
    "stored_ranges",
    "stored_ranges_of",
]

#: The raw read's buffer: the size of each ``preadv`` call.
READ_BYTES = 16 * 2**20


@dataclass
class Rate:
    """One measurement: samples and bytes over seconds."""

    samples: int
    bytes: int
    seconds: float
    first_batch_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e6

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "mb_per_s": self.mb_per_s,
            "first_batch_seconds": self.first_batch_seconds,
            **self.extra,
        }


# --- the raw read ------------------------------------------------------------------------------


def _ranges(layout: Layout) -> list[tuple[str, int, int]]:
    """(file, offset, size) of every stored byte of one top of one file (empty: unknown)."""
    if layout.path == "pread":
        return [(e.file.name, e.offset, e.size) for e in layout.extents]
    if layout.path == "chunks":
        c = layout.chunks
        assert c is not None
        pairs = zip(c.offsets.ravel(), c.sizes.ravel(), strict=True)
        return [(c.file.name, int(o), int(s)) for o, s in pairs]
    file = layout.file
    if file is None:
        return []
    with file.pinned():
        dset = layout.open_dataset()
        if dset.chunks is not None:
            found: list[tuple[str, int, int]] = []
            dset.id.chunk_iter(lambda info: found.append((file.name, info.byte_offset, info.size)))
            return found
        offset = dset.id.get_offset()
        size = int(dset.id.get_storage_size())
    return [] if offset is None else [(file.name, int(offset), size)]


def _stored_layouts(file: FileInfo) -> list[Layout]:
    """The layouts of every dataset the file's tops read rows from: each top's, and a sparse
    top's ``indices`` beside its ``data`` (a sparse top's layout is its ``data``'s; its column
    indices are as many bytes again, read with them)."""
    found = list(file.layouts.values())
    found += [parts.indices for parts in file.ragged.values() if parts.indices is not None]
    return found


def stored_ranges(catalog: Catalog) -> list[tuple[str, int, int]]:
    """The tops' stored bytes (a sparse top's values and column indices), in file order,
    adjacent ranges merged."""
    found = sorted(r for f in catalog.files for lay in _stored_layouts(f) for r in _ranges(lay))
    merged: list[tuple[str, int, int]] = []
    for name, offset, size in found:
        if merged and merged[-1][0] == name and merged[-1][1] + merged[-1][2] >= offset:
            n, o, s = merged[-1]
            merged[-1] = (n, o, max(s, offset + size - o))
        else:
            merged.append((name, offset, size))
    return merged


def stored_ranges_of(paths: Sequence[str], tops: Sequence[str]) -> list[tuple[str, int, int]]:
    """:func:`stored_ranges` of local HDF5 files (their catalog built, then closed, here)."""
    source = LocalSource()
    try:
        return stored_ranges(build_catalog(source, list(paths), tuple(tops)))
    finally:
        source.close()


def read_ranges(ranges: Iterable[tuple[str, int, int]], buffer: memoryview) -> tuple[int, float]:
    """Read every byte of ``ranges`` (file, offset, size) with ``os.preadv`` into ``buffer``,
    reused, each call at most its size (blocking).

    Returns
    -------
    tuple
        The bytes read and the seconds from the call to the end of the first ``preadv``.
    """
    fds: dict[str, int] = {}
    total, first = 0, 0.0
    start = time.perf_counter()
    try:
        for name, offset, size in ranges:
            fd = fds.get(name)
            if fd is None:
                fd = fds[name] = os.open(name, os.O_RDONLY)
            done = 0
            while done < size:
                piece = buffer[: min(len(buffer), size - done)]
                got = pread_into(fd, piece, offset + done)
                if got < len(piece):
                    raise OSError(f"{name}: short read at byte {offset + done + got}")
                done += got
                first = first or time.perf_counter() - start
            total += size
    finally:
        for fd in fds.values():
            os.close(fd)
    return total, first


def raw_read(ranges: Sequence[tuple[str, int, int]], samples: int) -> Rate:
    """Read ``ranges`` with ``os.preadv`` into one reused buffer (blocking)."""
    buffer = memoryview(bytearray(READ_BYTES))
    start = time.perf_counter()
    total, _ = read_ranges(ranges, buffer)
    seconds = time.perf_counter() - start
    return Rate(samples, total, seconds, extra={"ranges": len(ranges)})


# --- in RAM ------------------------------------------------------------------------------------


def gather_epoch(
    arrays: Sequence[np.ndarray],
    batch_size: int,
    seed: int,
    batch: Callable[[int], object] = lambda rows: None,
) -> None:
    """One shuffled epoch served from ``arrays`` in RAM: one permutation of their rows
    (``np.random.default_rng(seed)``), then per batch one ``np.take`` of each array into a
    reused buffer, in ``mode="clip"`` as the layer gathers (the default mode gathers into a
    temporary and copies it over). ``batch(rows)`` is called after each batch."""
    n = len(arrays[0])
    outs = [np.empty((batch_size, *a.shape[1:]), a.dtype) for a in arrays]
    perm = np.random.default_rng(seed).permutation(n)
    for lo in range(0, n, batch_size):
        index = perm[lo : lo + batch_size]
        for a, out in zip(arrays, outs, strict=True):
            np.take(a, index, axis=0, out=out[: len(index)], mode="clip")
        batch(len(index))


def in_ram(catalog: Catalog, batch_size: int, seed: int) -> Rate:
    """Every top in memory (a categorical top's codes, a compound field's values, a Windows
    top's windows as the layer's cache holds them), then one epoch served by
    :func:`gather_epoch` (blocking). Fixed-shape tops only: a ragged or sparse top's rows are
    not rows of one array."""
    n = catalog.n_samples
    start = time.perf_counter()
    arrays = {t.name: np.empty((n, *t.sample_shape), t.dtype) for t in catalog.tops.values()}
    for f in catalog.files:
        if f.nrows == 0:
            continue
        with h5py.File(f.name, "r") as h5:
            for name, a in arrays.items():
                cut = catalog.tops[name].windows
                if cut is not None:  # window r is stream[r * stride : r * stride + length]
                    length, stride = cut
                    stream = h5[name][: (f.nrows - 1) * stride + length]
                    windows = sliding_window_view(stream, length)[::stride]
                    a[f.start : f.start + f.nrows] = windows
                    continue
                field = compound_field(h5, name)
                if field is not None:  # a field of a compound dataset (a pandas column)
                    table, field_name = field
                    a[f.start : f.start + f.nrows] = table.fields(field_name)[()]
                    continue
                coded = categorical(f.name, h5, name) if name in f.categories else None
                dset = h5[name if coded is None else coded[0]]
                dset.read_direct(a, dest_sel=np.s_[f.start : f.start + f.nrows])
    load = time.perf_counter() - start
    first: list[float] = []

    def batch(rows: int) -> None:
        if not first:
            first.append(time.perf_counter() - start)

    start = time.perf_counter()
    gather_epoch(list(arrays.values()), batch_size, seed, batch)
    seconds = time.perf_counter() - start
    first_s = first[0] if first else None
    return Rate(n, n * catalog.row_bytes, seconds, first_s, {"load_seconds": load})
