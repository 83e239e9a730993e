"""What the batcher cuts: chunks whose rows are in memory (:class:`LoadedChunk`), the rows of
an incomplete batch carried out of them (:class:`Carry`), and the specs of batches and groups of
batches (:class:`BatchSpec`, :class:`GroupSpec`) as pieces ``(chunk, start, stop)`` of serving
orders.

A spec holds references to its chunks until it is gathered: a cache slot goes back to the
reader once its chunk is cut and nothing refers to it. A chunk's lifetime (``refs``, ``cut``,
``release``) is written here only, through :class:`LoadedChunk`'s methods: the reader stage
says how its slot goes back (:meth:`~LoadedChunk.on_release`), the batcher holds it per batch
cut (:meth:`~LoadedChunk.hold`) and says when every row is cut (:meth:`~LoadedChunk.all_cut`),
and whoever is done with a batch lets go (:meth:`~LoadedChunk.let_go`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from ._blocks import Stored
from ._plan import ChunkPlan

__all__ = [
    "BatchSpec",
    "Carry",
    "GroupSpec",
    "LoadedChunk",
    "Piece",
    "Rows",
    "merge_pieces",
    "split_pieces",
]


class Rows(Stored, Protocol):
    """What the gather takes one top's rows from: an array, or rows served where a mapped file
    stores them (:class:`~._read._maps.ChunkRows`, :class:`~._read._maps.Spliced`), which are no
    array: rows by :meth:`take` (``np.take``'s call: ``axis=0``, into ``out``) or by a slice,
    bounded by ``len()``. A ragged top's spans are always arrays; its values an array or a
    mapped heap in chunks (:class:`~._blocks.ScatteredValues`)."""

    def take(
        self,
        indices: np.ndarray,
        /,
        axis: int = ...,
        *,
        out: np.ndarray,
        mode: Literal["raise", "wrap", "clip"] = ...,
    ) -> np.ndarray: ...


@dataclass(eq=False)
class LoadedChunk:
    """A chunk whose rows are in memory.

    ``arrays`` are a cache slot's arrays (rows at slot positions) or, for in-memory or mapped
    data, the whole rows (at global indices: ``rows_are_global``), mapped ones no array.
    """

    plan: ChunkPlan
    order: np.ndarray | None  # slot positions in serving order (None: slot order, or not needed)
    arrays: Mapping[str, Rows]
    indices: np.ndarray  # global indices of the served samples, in serving order
    rows_are_global: bool = False
    #: Every row the gather will take (``order``, or ``indices`` when global) was checked to be
    #: in ``arrays`` (:func:`check_rows`) when the chunk was loaded: not again per batch.
    checked: bool = False
    #: How the chunk's slot goes back (None: nothing to give back, or given back already).
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

    def on_release(self, release: Callable[[], None] | None) -> None:
        """Give the slot back with ``release`` once it is fully cut and every batch from it is
        gathered and taken (None: nothing to give back, or the run gives it back itself)."""
        self.release = release

    def hold(self) -> None:
        """A batch was cut from it: held until that batch is let go of."""
        self.refs += 1

    def all_cut(self) -> None:
        """Every row has been cut into a batch (or dropped)."""
        self.cut = True
        self._done_with()

    def let_go(self) -> None:
        """A batch cut from it was gathered and taken (or carried out of it)."""
        self.refs -= 1
        self._done_with()

    def _done_with(self) -> None:
        """Give the slot back once it is fully cut and every batch from it let go of."""
        if self.cut and self.refs == 0 and self.release is not None:
            release, self.release = self.release, None
            release()


@dataclass(eq=False)
class Carry:
    """Rows of an incomplete batch copied out of the chunks they came from (see :func:`carry`),
    in serving order, with their global indices."""

    arrays: Mapping[str, np.ndarray]
    indices: np.ndarray

    def hold(self) -> None:
        """Nothing to count: the carry is the batch's own memory."""

    def let_go(self) -> None:
        """Nothing to give back: the carry is the batch's own memory."""


Piece = tuple["LoadedChunk | Carry", int, int]


@dataclass(eq=False)
class BatchSpec:
    """A batch being cut: pieces ``(chunk, start, stop)`` of chunks' serving orders."""

    epoch: int
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0
    ends_epoch: int | None = None  # an epoch whose last sample is in this batch
    schema: int | None = None  # streams of different schemas: its rows' (:mod:`._schemas`)


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
    #: Streams of different schemas (:mod:`._schemas`): the group's runs of batches of one
    #: schema, in order, ``(batches, {top: internal top})``: each batch gathers only its
    #: schema's arrays, handed over under the tops' names. None: every batch has every top.
    schemas: list[tuple[int, Mapping[str, str]]] | None = None

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def add(self, chunk: LoadedChunk | Carry, start: int, stop: int) -> None:
        """Rows ``start:stop`` of ``chunk``'s serving order (joined to the last piece when they
        continue it); the chunk is held until the group is gathered."""
        chunk.hold()
        self.pieces.append((chunk, start, stop))

    def batch_tops(self) -> list[Mapping[str, str]] | None:
        """Each batch's ``{top: internal top}`` (:attr:`schemas`); None: every top."""
        if self.schemas is None:
            return None
        return [tops for n, tops in self.schemas for _ in range(n)]

    def batch_pieces(self) -> Iterator[list[Piece]]:
        """The pieces of each batch, in order."""
        rest: list[Piece] = list(self.pieces)
        for size in self.sizes:
            head, rest = split_pieces(rest, size)
            yield head


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
