"""The steps of a read plan: what moves each piece of a chunk into its cache slot.

Byte ranges straight into the slot's bytes (:func:`direct_ranges`, over a :func:`byte_view`),
pieces h5py reads (:class:`H5pyRead`, checking afterwards the files HDF5 opened by name), and byte
swaps after the bytes are in (:func:`swapper`); stored chunks are :mod:`._chunked`'s.
:class:`~asynchdf5._read.HDF5Reader` plans them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import numpy as np

from .._errors import ReadError
from .._layout import Layout
from .._sources import ByteRange
from .._windows import cut_windows, expand_in_place, token_range

__all__ = ["H5pyRead", "VlenRead", "byte_view", "direct_ranges", "swapper", "window_reads"]


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of ``a`` (C-contiguous: written through, never a copy)."""
    if not a.flags.c_contiguous:
        raise ValueError("a destination of direct reads must be C-contiguous")
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class H5pyRead:
    """Rows ``r0:r1`` of a top read by h5py into ``dest`` (blocking)."""

    __slots__ = ("about", "dest", "layout", "r0", "r1")

    def __init__(self, layout: Layout, r0: int, r1: int, dest: np.ndarray, about: str) -> None:
        self.layout, self.r0, self.r1, self.dest, self.about = layout, r0, r1, dest, about

    def __call__(self) -> int:
        layout = self.layout
        assert layout.file is not None
        with contextlib.ExitStack() as stack:
            try:  # its h5py handle is not closed under the read (opened again if it was)
                stack.enter_context(layout.file.pinned())
                dataset = layout.open_dataset()
            except ReadError as exc:  # it changed while it was closed
                raise ReadError(f"{self.about}: {exc}") from exc
            try:
                if layout.field:  # a field of compound records: h5py picks it out
                    self.dest[...] = dataset.fields(layout.field)[self.r0 : self.r1]
                else:
                    dataset.read_direct(self.dest, np.s_[self.r0 : self.r1])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # TypeError: h5py's "Can't broadcast" when the dataset no longer has the rows.
                self._check()  # a file that changed is the cause to report
                raise ReadError(f"{layout.file.name}: {self.about}: read failed: {exc}") from exc
            self._check()
        return int(self.dest.nbytes)

    def _check(self) -> None:
        """The files this read used are as catalogued (by name, those HDF5 opens by name)."""
        layout = self.layout
        assert layout.file is not None
        try:
            layout.file.check()
            for dep in layout.depends:
                dep.check(by_name=True)
        except ReadError as exc:
            raise ReadError(f"{self.about}: {exc}") from exc


def direct_ranges(
    layout: Layout,
    r0: int,
    r1: int,
    view: memoryview,
    row_bytes: int,
    about: str,
    piece_bytes: int,
) -> list[ByteRange]:
    """Byte ranges of rows ``r0:r1`` over the layout's extents, straight into ``view`` (the
    bytes of their destination); none larger than ``piece_bytes`` (the source's)."""
    lo, hi = r0 * row_bytes, r1 * row_bytes
    out = []
    for ext in layout.extents:
        a, b = max(lo, ext.start), min(hi, ext.start + ext.size)
        while a < b:
            c = min(b, a + piece_bytes)
            out.append(
                ByteRange(
                    ext.file, ext.offset + a - ext.start, c - a, about, into=view[a - lo : c - lo]
                )
            )
            a = c
    return out


def swapper(dest: np.ndarray) -> Callable[[], None]:
    def swap() -> None:
        dest.view(dest.dtype.newbyteorder("S")).byteswap(inplace=True)

    return swap


def window_reads(
    dest: np.ndarray, r0: int, r1: int, length: int, stride: int
) -> tuple[int, int, np.ndarray, Callable[[], None]]:
    """How windows ``r0:r1`` of a :class:`~asynchdf5.Windows` top get into ``dest`` (their
    ``(n, length)`` rows): the stream's elements ``t0:t1`` to read, read into ``into`` (1-D),
    then ``cut`` (blocking: a pass over the windows' bytes) cuts the windows out of them.

    With ``stride <= length`` the elements fit in ``dest`` itself: they are read into the end of
    its buffer and the windows are moved forwards in place. With ``stride > length`` the
    elements between windows are read too (one contiguous read, not one per window), into a
    buffer of their own.
    """
    t0, t1 = token_range(r0, r1, length, stride)
    n = r1 - r0
    if stride <= length:
        into = dest.reshape(-1)[n * length - (t1 - t0) :]
        return t0, t1, into, partial(expand_in_place, dest, stride)
    buffer = np.empty(t1 - t0, dest.dtype)
    return t0, t1, buffer, partial(cut_windows, dest, buffer, stride)


class VlenRead(H5pyRead):
    """Rows ``r0:r1`` of a variable-length dataset read by h5py, their values concatenated
    into ``dest`` (blocking). HDF5 keeps such rows in a heap that only it reads: this holds
    h5py's lock, and copies every value once more (out of h5py's arrays, one per row)."""

    __slots__ = ()

    def __call__(self) -> int:
        layout = self.layout
        assert layout.file is not None
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(layout.file.pinned())
                dataset = layout.open_dataset()
            except ReadError as exc:
                raise ReadError(f"{self.about}: {exc}") from exc
            try:
                rows = dataset[self.r0 : self.r1]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self._check()
                raise ReadError(f"{layout.file.name}: {self.about}: read failed: {exc}") from exc
            self._check()
        at = 0
        for row in rows:
            n = len(row)
            if at + n > len(self.dest):
                break
            self.dest[at : at + n] = row
            at += n
        if at != len(self.dest) or sum(len(r) for r in rows) != len(self.dest):
            raise ReadError(
                f"{layout.file.name}: {self.about}: the rows hold other lengths than when the "
                "file was opened (changed under the layer?)"
            )
        return int(self.dest.nbytes)
