"""The batcher's types: chunks whose rows are in memory, the batches cut from them, and the
gathering of a batch's rows (from cache slots, in-memory arrays or a carry) into arrays.

Delivery (``_delivery``) decides where gathered rows go and what a :class:`Batch` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import ReadError
from ._plan import ChunkPlan

__all__ = [
    "Batch",
    "BatchSpec",
    "Carry",
    "GroupSpec",
    "LoadedChunk",
    "Piece",
    "carry",
    "gather_rows",
    "merge_pieces",
    "rows_words",
    "split_pieces",
    "verify",
]


class Batch(Mapping[str, Any]):
    """One minibatch: a read-only mapping from top name to an array whose rows are samples.

    Attributes
    ----------
    indices : numpy.ndarray
        int64, the global index of each row's sample, in row order.
    epoch : int
        The epoch the batch belongs to (for :meth:`AsyncHDF5DataLayer.stream`, the epoch it
        started in).
    streams : numpy.ndarray or None
        With several streams (``source={name: Stream(...)}``): the stream each row came from,
        as an index into the layer's ``stream_names``, in row order; ``None`` without.
    """

    __slots__ = ("_data", "epoch", "indices", "streams")

    def __init__(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> None:
        self._data = data
        self.indices = indices
        self.epoch = epoch
        self.streams: np.ndarray | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return len(self.indices)

    def __repr__(self) -> str:
        tops = ", ".join(
            f"{k!r}: {type(v).__module__.split('.')[0]}{tuple(v.shape)} {v.dtype}"
            for k, v in self._data.items()
        )
        return f"Batch(epoch={self.epoch}, rows={self.size}, {{{tops}}})"


@dataclass(eq=False)
class LoadedChunk:
    """A chunk whose rows are in memory.

    ``arrays`` are a cache slot's arrays (rows at slot positions) or, for in-memory data, the
    whole arrays (rows at global indices: ``rows_are_global``).
    """

    plan: ChunkPlan
    order: np.ndarray | None  # slot positions in serving order (None: slot order, or not needed)
    arrays: Mapping[str, np.ndarray]
    indices: np.ndarray  # global indices of the served samples, in serving order
    rows_are_global: bool = False
    #: Every row the gather will take (``order``, or ``indices`` when global) was checked to be
    #: in ``arrays`` (:func:`check_rows`) when the chunk was loaded: not again per batch.
    checked: bool = False
    release: Callable[[], None] | None = None
    #: Rows taken in place from memory that the file may change under (a mapped file): called
    #: after rows were gathered from it and before they go anywhere; raises ReadError if the
    #: file changed since the chunk was read (None: nothing can change them).
    verify: Callable[[], None] | None = None
    #: Held around every gather from ``arrays`` when they are a mapped file's (see
    #: :attr:`~asynchdf5._read.Reader.guard`); None: no gather needs one.
    guard: AbstractContextManager[None] | None = None
    refs: int = 0  # batches cut from it and not yet gathered
    cut: bool = False  # every row has been cut into a batch (or dropped)

    @property
    def size(self) -> int:
        return self.plan.size

    def done_with(self) -> None:
        """Give the slot back once it is fully cut and every batch from it gathered."""
        if self.cut and self.refs == 0 and self.release is not None:
            release, self.release = self.release, None
            release()


@dataclass(eq=False)
class Carry:
    """Rows of an incomplete batch copied out of the chunks they came from (see :func:`carry`),
    in serving order, with their global indices."""

    arrays: Mapping[str, np.ndarray]
    indices: np.ndarray
    refs: int = 0

    def done_with(self) -> None:
        """Nothing to give back: the carry is the batch's own memory."""


Piece = tuple["LoadedChunk | Carry", int, int]


@dataclass(eq=False)
class BatchSpec:
    """A batch being cut: pieces ``(chunk, start, stop)`` of chunks' serving orders."""

    epoch: int
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0
    ends_epoch: int | None = None  # an epoch whose last sample is in this batch


@dataclass(eq=False)
class GroupSpec:
    """Batches gathered in one go: the pieces holding all their rows, in order, and each batch's
    size and epoch. A run of whole batches from one chunk is one piece (the batcher's Python
    work per batch is a few list items, not an object)."""

    pieces: list[Piece] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    #: Batch number -> the epoch that ends with it (a stream batch wrapping into the next).
    ends: dict[int, int] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def add(self, chunk: LoadedChunk | Carry, start: int, stop: int) -> None:
        """Rows ``start:stop`` of ``chunk``'s serving order (joined to the last piece when they
        continue it); the chunk is held until the group is gathered."""
        chunk.refs += 1
        self.pieces.append((chunk, start, stop))

    def batch_pieces(self) -> Iterator[list[Piece]]:
        """The pieces of each batch, in order."""
        rest: list[Piece] = list(self.pieces)
        for size in self.sizes:
            head, rest = split_pieces(rest, size)
            yield head


def verify(pieces: Sequence[Piece]) -> None:
    """Run the ``verify`` of every chunk the pieces were gathered from (see
    :attr:`LoadedChunk.verify`): after the gather, before the rows go anywhere."""
    checks = {c.verify: c for c, _, _ in pieces if isinstance(c, LoadedChunk) and c.verify}
    for check, chunk in checks.items():
        try:
            check()
        except ReadError as exc:  # named as the copying reader names a read's rows
            idx = [c.indices[a:b] for c, a, b in pieces if isinstance(c, LoadedChunk)]
            tops = ", ".join(map(repr, chunk.arrays))
            raise ReadError(f"top {tops}, {rows_words(np.concatenate(idx))}: {exc}") from exc


def rows_words(indices: np.ndarray) -> str:
    """Global rows in an error message: ``rows a:b`` when they are that run, else how many and
    the range they lie in."""
    n = len(indices)
    if n == 0:
        return "no rows"
    lo, hi = int(indices.min()), int(indices.max())
    if hi - lo == n - 1 and (n == 1 or bool(np.all(np.diff(indices) == 1))):
        return f"rows {lo}:{hi + 1}"
    return f"{n} rows in {lo}:{hi + 1}"


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Join pieces that continue each other (consecutive batches of one chunk): one ``take``."""
    out: list[Piece] = []
    for chunk, a, b in pieces:
        if out and out[-1][0] is chunk and out[-1][2] == a:
            out[-1] = (chunk, out[-1][1], b)
        else:
            out.append((chunk, a, b))
    return out


def split_pieces(pieces: Sequence[Piece], rows: int) -> tuple[list[Piece], list[Piece]]:
    """The first ``rows`` rows of ``pieces``, and the rest."""
    head: list[Piece] = []
    tail: list[Piece] = []
    left = rows
    for chunk, a, b in pieces:
        if left >= b - a:
            head.append((chunk, a, b))
            left -= b - a
        elif left > 0:
            head.append((chunk, a, a + left))
            tail.append((chunk, a + left, b))
            left = 0
        else:
            tail.append((chunk, a, b))
    return head, tail


def gather_rows(
    pieces: Sequence[Piece], out: dict[str, np.ndarray], indices: np.ndarray, at: int = 0
) -> None:
    """Copy the rows of ``pieces`` into ``out`` and their global indices into ``indices``,
    from row ``at`` on."""
    for chunk, a, b in pieces:
        n = b - a
        idx = indices[at : at + n]
        rows: np.ndarray | slice
        if isinstance(chunk, Carry):  # rows and indices in serving order
            idx[:] = chunk.indices[a:b]
            for name, dest in out.items():
                dest[at : at + n] = chunk.arrays[name][a:b]
            at += n
            continue
        idx[:] = chunk.indices[a:b]
        if chunk.rows_are_global:
            rows = idx
        else:
            rows = slice(a, b) if chunk.order is None else chunk.order[a:b]
        if not isinstance(rows, slice) and n and not chunk.checked:
            # The take below writes straight into ``dest`` (mode="clip"), so the bounds are
            # checked instead: once per chunk when it was loaded, else here.
            check_rows(rows, chunk.arrays)
        guard = chunk.guard
        for name, dest in out.items():
            if guard is None:
                _take(chunk.arrays[name], rows, dest[at : at + n])
            else:  # each top's copy on its own: the guard's check right before it
                try:
                    guard.__enter__()
                except ReadError as exc:  # named as the copying reader names a read's rows
                    raise ReadError(f"top {name!r}, {rows_words(idx)}: {exc}") from exc
                try:
                    _take(chunk.arrays[name], rows, dest[at : at + n])
                finally:
                    guard.__exit__(None, None, None)
        at += n


def _take(source: np.ndarray, rows: np.ndarray | slice, dest: np.ndarray) -> None:
    """Copy ``rows`` of ``source`` into ``dest``."""
    if isinstance(rows, slice):
        dest[...] = source[rows]
    else:
        # mode="clip" writes straight into ``dest``; numpy's default ("raise") gathers into
        # a temporary first and copies it over (measured: 1.4-2x slower for image batches).
        np.take(source, rows, axis=0, out=dest, mode="clip")


def check_rows(rows: np.ndarray, arrays: Mapping[str, np.ndarray]) -> None:
    """:class:`IndexError` unless every one of ``rows`` is a row of every array: ``np.take``
    with ``mode="clip"`` (which gathers straight into a batch) would silently clip the others.
    Two passes over ``rows``: the loader runs it once per chunk, so that the gather need not."""
    if len(rows):
        lo, hi = int(rows.min()), int(rows.max())
        for name, a in arrays.items():
            if lo < 0 or hi >= len(a):
                raise IndexError(f"rows {lo}..{hi} of {len(a)} (top {name!r})")


def carry(spec: BatchSpec, tops: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> Carry:
    """Copy the rows cut so far into an incomplete batch out of the chunks they are in.

    The batcher calls this when it has cut every row of a chunk and the batch it is building
    still needs rows from the next one: the copy (fewer than ``batch_size`` rows) lets the
    chunk's cache slot go back to the reader without waiting for that next chunk. Blocking:
    run in a worker thread.

    Rows of a mapped file are checked here (:func:`verify`), as after every gather, and not only
    after the gather that completes the batch: a later check can miss a change this one sees (a
    file rewritten in place, its modification time set back, then linked or unlinked: the two
    moves of its change time look like one link change).
    """
    arrays = {name: np.empty((spec.rows, *shape), dtype) for name, (shape, dtype) in tops.items()}
    indices = np.empty(spec.rows, np.int64)
    gather_rows(spec.pieces, arrays, indices)
    verify(spec.pieces)  # rows of a mapped file: unchanged when they were copied
    return Carry(arrays, indices)
