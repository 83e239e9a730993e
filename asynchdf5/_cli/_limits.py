"""The limits ``asynchdf5 bench`` measures the layer against: the raw read of the stored bytes
and the in-RAM ceiling (blocking code, run outside any event loop)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from .._catalog import Catalog
from .._layout import Layout

__all__ = ["READ_BYTES", "Rate", "in_ram", "raw_read", "stored_ranges"]

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


def stored_ranges(catalog: Catalog) -> list[tuple[str, int, int]]:
    """The tops' stored bytes, in file order, adjacent ranges merged."""
    found = sorted(r for f in catalog.files for lay in f.layouts.values() for r in _ranges(lay))
    merged: list[tuple[str, int, int]] = []
    for name, offset, size in found:
        if merged and merged[-1][0] == name and merged[-1][1] + merged[-1][2] >= offset:
            n, o, s = merged[-1]
            merged[-1] = (n, o, max(s, offset + size - o))
        else:
            merged.append((name, offset, size))
    return merged


def raw_read(ranges: Sequence[tuple[str, int, int]], samples: int) -> Rate:
    """Read ``ranges`` with ``os.preadv`` into one reused buffer (blocking)."""
    buffer = memoryview(bytearray(READ_BYTES))
    fds: dict[str, int] = {}
    total = 0
    try:
        start = time.perf_counter()
        for name, offset, size in ranges:
            fd = fds.get(name)
            if fd is None:
                fd = fds[name] = os.open(name, os.O_RDONLY)
            done = 0
            while done < size:
                got = os.preadv(fd, [buffer[: min(READ_BYTES, size - done)]], offset + done)
                if got <= 0:
                    raise OSError(f"{name}: short read at byte {offset + done}")
                done += got
            total += size
        seconds = time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)
    return Rate(samples, total, seconds, extra={"ranges": len(ranges)})


# --- in RAM ------------------------------------------------------------------------------------


def in_ram(catalog: Catalog, batch_size: int, seed: int) -> Rate:
    """Every top in memory, then one permutation served with ``np.take`` (blocking)."""
    n = catalog.n_samples
    start = time.perf_counter()
    arrays = {t.name: np.empty((n, *t.sample_shape), t.dtype) for t in catalog.tops.values()}
    for f in catalog.files:
        if f.nrows == 0:
            continue
        with h5py.File(f.name, "r") as h5:
            for name, a in arrays.items():
                h5[name].read_direct(a, dest_sel=np.s_[f.start : f.start + f.nrows])
    load = time.perf_counter() - start
    outs = {k: np.empty((batch_size, *a.shape[1:]), a.dtype) for k, a in arrays.items()}
    perm = np.random.default_rng(seed).permutation(n)
    start = time.perf_counter()
    first: float | None = None
    for lo in range(0, n, batch_size):
        index = perm[lo : lo + batch_size]
        for k, a in arrays.items():
            np.take(a, index, axis=0, out=outs[k][: len(index)])
        if first is None:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return Rate(n, n * catalog.row_bytes, seconds, first, {"load_seconds": load})
