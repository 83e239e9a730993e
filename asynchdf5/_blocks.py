"""Copying runs of values between arrays, many runs at once: the kernel under a ragged top's
gather (:func:`~._gather.gather_ragged`).

A run is ``count`` values (rows along the first axis) from ``start`` in a source array, copied
to ``at`` in a destination. Thousands of short runs (a shuffled batch's rows) cost one Python
step each when copied a slice each, more than their bytes take to move. So they are copied in
blocks of fixed sizes instead (:data:`BLOCK_BYTES`): a run goes in blocks of the largest size
it holds, the runs of one size all together, by one fancy index over a view of the source whose
items are the blocks starting at every value (and the same over the destination). A run's last
block ends at the run's end, over bytes its previous block copied (the same bytes), so every
write stays inside its run and the order of the writes does not matter. Runs shorter than the
smallest block are copied value by value, by one index over their values; long runs
(:data:`RUN_BYTES` on average) a slice each, where a Python step costs less than the bytes.

Values that are no one array (:class:`ScatteredValues`: a mapped heap stored in chunks) copy
their own runs; :func:`copy_all` copies runs out of either.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BLOCK_BYTES",
    "RELEASE_ITEMS",
    "RUN_BYTES",
    "ScatteredValues",
    "Stored",
    "copy_all",
    "copy_runs",
    "row_bytes",
    "stage_blocks",
    "value_windows",
]

#: Runs of at least this many bytes on average are copied a slice each.
RUN_BYTES = 64 * 2**10
#: The block sizes (bytes) shorter runs are copied in: a run goes in blocks of the largest size
#: it holds, fewer than four of them unless it is longer than the largest. A block from memory
#: costs about what a few hundred bytes take to move, whatever its size: blocks are few and large.
BLOCK_BYTES = (4096, 1024, 256, 64)
#: The most bytes copied through one temporary at a time (it stays in the processor's cache),
#: unless that is fewer than :data:`RELEASE_ITEMS` blocks.
STAGE_BYTES = 256 * 2**10
#: The fewest blocks copied through one temporary at a time: NumPy lets go of the GIL during
#: an index only when it has more than 500 items, and a copy that holds it keeps the other
#: gathering thread from copying at the same time (two threads copy no faster than one).
RELEASE_ITEMS = 512


class Stored(Protocol):
    """What an array of rows (or values) along its first axis that is no one array shows of
    itself: the mapped reader's rows and heaps (:class:`~._specs.Rows`,
    :class:`ScatteredValues`). Indexed by a slice (a step of 1), it copies them out."""

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, rows: slice, /) -> np.ndarray: ...


class ScatteredValues(Stored, Protocol):
    """Values (along the first axis) held where they are no one array, which copy runs of
    themselves (:class:`~._read._maps.ChunkHeap`: a mapped heap stored in chunks)."""

    def copy_into(
        self, dest: np.ndarray, start: np.ndarray, at: np.ndarray, count: np.ndarray
    ) -> None:
        """:func:`copy_runs` from these values into ``dest`` (C-contiguous, their dtype)."""
        ...

    def copy_many(
        self,
        values: Sequence[ScatteredValues],
        dests: Sequence[np.ndarray],
        start: np.ndarray,
        at: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """:meth:`copy_into` of the same runs from each of ``values`` (of this kind) into its
        ``dests`` entry, sharing the work that depends on the runs alone."""
        ...


def copy_all(
    sources: Sequence[np.ndarray | ScatteredValues],
    dests: Sequence[np.ndarray],
    start: np.ndarray,
    at: np.ndarray,
    count: np.ndarray,
) -> None:
    """:func:`copy_runs` from sources that are arrays or :class:`ScatteredValues` (of one
    kind), the arrays together and the others together."""
    arrays = [(s, d) for s, d in zip(sources, dests, strict=True) if isinstance(s, np.ndarray)]
    others = [(s, d) for s, d in zip(sources, dests, strict=True) if not isinstance(s, np.ndarray)]
    if arrays:
        copy_runs([s for s, _ in arrays], [d for _, d in arrays], start, at, count)
    if others:
        first = others[0][0]
        assert not isinstance(first, np.ndarray)
        rest = [s for s, _ in others if not isinstance(s, np.ndarray)]
        first.copy_many(rest, [d for _, d in others], start, at, count)


def row_bytes(a: np.ndarray) -> int:
    """The bytes of one value of ``a`` (one row along its first axis). (``math.prod`` of the
    few Python ints of a shape costs a tenth of ``np.prod``: this runs per batch and piece.)"""
    return a.dtype.itemsize * math.prod(a.shape[1:])


def copy_runs(
    sources: Sequence[np.ndarray],
    dests: Sequence[np.ndarray],
    start: np.ndarray | Sequence[np.ndarray],
    at: np.ndarray,
    count: np.ndarray,
    grain: int = 1,
) -> None:
    """Copy ``source[start[i] : start[i] + count[i]]`` to ``dest[at[i] : at[i] + count[i]]``
    for every run ``i`` (int64 arrays) and every pair of ``sources`` and ``dests`` (a sparse
    top's values and column indices share their runs). The runs must lie inside both arrays
    and the destinations of different runs must not overlap; sources may.

    ``start``: one array for every source, or one array per source (the same runs, each from
    its own place: a mapped heap's values and column indices lie in different chunks).
    ``grain``: every count is a multiple of it, and runs shorter than the smallest block are
    copied that many values at a time (a mapped heap in chunks is copied as bytes, runs of
    whole values: :class:`~._read._maps.ChunkHeap`)."""
    starts = [start] * len(sources) if isinstance(start, np.ndarray) else list(start)
    sizes = [row_bytes(a) for a in sources]
    rb = max(sizes)  # the blocks' sizes count values: of the widest source's
    if len(count) == 0 or rb == 0:
        return
    contiguous = all(a.flags.c_contiguous for a in (*sources, *dests))
    if not contiguous or int(count.sum()) * rb >= RUN_BYTES * len(count):
        for source, dest, s in zip(sources, dests, starts, strict=True):
            for a, b, n in zip(s.tolist(), at.tolist(), count.tolist(), strict=True):
                dest[b : b + n] = source[a : a + n]
        return
    # Each run's class, once: 0 (shorter than the smallest block: copied grain by grain) or i,
    # in blocks of ``blocks[i - 1]`` values (the largest it holds).
    blocks = _block_values(rb)
    group = np.searchsorted(blocks, count, side="right")
    held = np.bincount(group, minlength=len(blocks) + 1).tolist()
    if held[0]:  # runs of no values are among the short ones: dropped (they copy nothing)
        keep = count > 0
        if not keep.all():
            at, count, group = at[keep], count[keep], group[keep]
            kept = {id(s): s[keep] for s in starts}  # a start shared stays shared
            starts = [kept[id(s)] for s in starts]
            held[0] -= len(keep) - len(count)
    present = [c for c, n in enumerate(held) if n]
    if not present:
        return
    # Every block of every run placed at once, the runs ordered by class (each class's blocks
    # then a slice of them): a run of ``count`` values goes in ``k`` blocks of its class's
    # ``size``, at ``size`` apart, its last one ending at the run's end.
    size_of = (grain, *blocks.tolist())
    sz: int | np.ndarray
    if len(present) == 1:
        sz = size_of[present[0]]
    else:
        order = np.argsort(group, kind="stable")
        at, count = at[order], count[order]
        moved = {id(s): s[order] for s in starts}  # a start shared stays shared
        starts = [moved[id(s)] for s in starts]
        sz = np.repeat(np.array([size_of[c] for c in present]), [held[c] for c in present])
    k = -(-count // sz)
    ends = np.cumsum(k)
    place = np.arange(int(ends[-1]), dtype=np.int64)
    place -= np.repeat(ends - k, k)  # each block's number in its run
    place *= sz if isinstance(sz, int) else np.repeat(sz, k)
    place[ends - 1] = count - sz
    d_at = np.repeat(at, k) + place
    s_ats: dict[int, np.ndarray] = {}  # where the blocks start, once per start array
    for s in starts:
        if id(s) not in s_ats:
            s_ats[id(s)] = np.repeat(s, k) + place
    run = lo = 0
    for c in present:
        run += held[c]
        hi = int(ends[run - 1])
        for source, dest, width, s in zip(sources, dests, sizes, starts, strict=True):
            _copy_blocks(source, dest, s_ats[id(s)][lo:hi], d_at[lo:hi], size_of[c], width)
        lo = hi


@functools.cache
def _block_values(rb: int) -> np.ndarray:
    """The block sizes (values of ``rb`` bytes) runs are copied in, smallest first: those of
    :data:`BLOCK_BYTES` of at least two values."""
    blocks = np.array(sorted({b // rb for b in BLOCK_BYTES if b >= 2 * rb}), np.int64)
    blocks.flags.writeable = False  # shared by every call
    return blocks


def stage_blocks(nbytes: int) -> int:
    """How many blocks of ``nbytes`` one copy moves through its temporary at a time: what
    :data:`STAGE_BYTES` holds, and never fewer than :data:`RELEASE_ITEMS` (so that the copy
    lets go of the GIL)."""
    return max(RELEASE_ITEMS, STAGE_BYTES // max(1, nbytes))


def value_windows(a: np.ndarray, size: int, rb: int) -> np.ndarray:
    """``a`` (C-contiguous) as one item per value: the ``size`` values from it on, as bytes
    (the items overlap; there are ``size - 1`` fewer than values)."""
    view: np.ndarray = np.ndarray((len(a) - size + 1,), np.dtype(f"V{size * rb}"), a, 0, (rb,))
    return view


def _copy_blocks(
    source: np.ndarray, dest: np.ndarray, s_at: np.ndarray, d_at: np.ndarray, size: int, rb: int
) -> None:
    """Copy the ``size`` values from each of ``s_at`` in ``source`` to the same of ``d_at`` in
    ``dest``, through a temporary of at most :data:`STAGE_BYTES` (or :data:`RELEASE_ITEMS`
    blocks) at a time."""
    if rb == 0:  # values of no bytes (a trailing shape with a 0)
        return
    src, out = value_windows(source, size, rb), value_windows(dest, size, rb)
    step = stage_blocks(size * rb)
    for a in range(0, len(s_at), step):
        b = a + step
        out[d_at[a:b]] = src[s_at[a:b]]
