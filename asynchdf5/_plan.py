"""Planner: pure functions from (samples, epoch, seed, shard) to the epoch's chunks and batches.

No I/O happens here, so shuffling and sharding are testable without a file (and so is resuming:
:mod:`._replan` continues these plans part-way).

The epoch's order. The samples lie on a ring, ``0 ... n-1``. With ``shuffle=False`` the epoch
walks the ring from 0. With ``shuffle=True`` (CorgiPile: block-wise random reads into a buffer,
then a shuffle within it) the ring is rotated by a random offset, cut into *blocks* of
``block_size`` contiguous samples (the last may be shorter), and the blocks are permuted: the
epoch walks the blocks in that order. Offset and permutation derive from ``(seed, epoch)`` alone,
so every rank computes the same order.

Shards. The epoch's walk is cut into ``world_size`` contiguous *shares*, one per rank, in rank
order. With ``q = n // (world_size * batch_size)`` full rounds and ``r = n % (world_size *
batch_size)`` samples left over, rank ``k`` gets ``q * batch_size`` samples plus a near-even part
of the leftover (``r // world_size``, plus one for the first ``r % world_size`` ranks). So every
rank has ``q`` full batches, and then:

* ``drop_last=True``: the leftover is left out of the epoch (with ``shuffle=True`` which samples
  those are changes from epoch to epoch): ``q`` full batches each.
* ``drop_last=False``: each rank yields its leftover as a last, partial batch. If the leftover is
  smaller than ``world_size`` (so some ranks got none), a rank without leftover splits its last
  full batch into two (``batch_size - 1`` rows, then 1) so that every rank still yields ``q + 1``
  batches: no sample is repeated or lost, and no batch is empty or larger than ``batch_size``.

Chunks. A rank's share is cut into chunks of ``chunk_size`` consecutive samples of the walk: with
``shuffle=True`` a chunk holds ``chunk_size / block_size`` blocks drawn from all over the data
set, read whole (each block is one large read), and its samples are served in a random order. The
first chunk of every epoch may be split into a ramp of growing sub-chunks (``first_rows``,
doubling) so the first batch does not wait for a whole chunk to be read.

Resuming. :func:`resume_plan` drops the part of an epoch already yielded (a chunk partly served
keeps the rest of its serving order); :func:`elastic_plan` re-splits what all the ranks of a run
with another world size had not yet yielded over this run's ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.random  # numpy imports it lazily: not on the event loop at the first plan

from ._errors import ConfigurationError
from ._walk import Lanes, Walk, append_range, growing_ramp, ramp, seed_tuple, within

__all__ = [
    "ChunkPlan",
    "EpochPlan",
    "batch_layout",
    "check_split",
    "plan_epoch",
    "shard_share",
]


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of an epoch: global index ranges, read whole into one cache slot in that order,
    and the part of its serving order that is served (all of it, but in a resumed epoch)."""

    epoch: int
    index: int  # position in the epoch's chunk order
    ranges: tuple[tuple[int, int], ...]  # global [start, stop) ranges, concatenated in the slot
    seed: tuple[int, ...] | None  # None: served in slot order
    serve: tuple[int, int] | None = None  # serve only order[a:b]
    #: The whole serving order, when it is not one permutation of the rows drawn from
    #: ``seed`` (a chunk of several streams, see :mod:`._mix`): slot positions, deterministic.
    arrange: Callable[[], np.ndarray] | None = None

    @functools.cached_property
    def rows(self) -> int:
        """Samples read into the slot."""
        return sum(b - a for a, b in self.ranges)

    @functools.cached_property
    def size(self) -> int:
        """Samples served from the chunk."""
        if self.serve is None:
            return self.rows
        a, b = self.serve
        return b - a

    def order(self) -> np.ndarray | None:
        """Slot positions in the order they are served (``None``: all of them, in slot order)."""
        if self.arrange is not None:
            whole = self.arrange()
            return whole if self.serve is None else whole[self.serve[0] : self.serve[1]]
        if self.seed is None:
            return None if self.serve is None else np.arange(*self.serve, dtype=np.int64)
        # The same permutation as ``Generator.permutation(rows)``, but shuffling an arange in
        # place releases the GIL and is faster: it leaves the event loop running where
        # ``permutation`` holds the GIL for long stretches.
        order: np.ndarray = np.arange(self.rows, dtype=np.int64)
        np.random.default_rng(self.seed).shuffle(order)
        return order if self.serve is None else order[self.serve[0] : self.serve[1]]

    @functools.cached_property
    def _offsets(self) -> tuple[np.ndarray, np.ndarray]:
        starts = np.array([a for a, _ in self.ranges], np.int64)
        lengths = np.array([b - a for a, b in self.ranges], np.int64)
        return starts, np.cumsum(lengths) - lengths  # slot position of each range's first row

    def served_indices(self, order: np.ndarray | None) -> np.ndarray:
        """Global indices of the served samples, in serving order (``order``: what
        :meth:`order` returned), from a map of every slot row to its global index, built once:
        a ``take`` per sample (a binary search over the ranges per sample costs CPU time in
        every epoch that a map made once does not)."""
        a, b = self.serve or (0, self.rows)
        out: np.ndarray
        if len(self.ranges) == 1:
            shift = self.ranges[0][0]
            if order is None:
                out = np.arange(a + shift, b + shift, dtype=np.int64)
            else:
                out = np.add(order, shift, dtype=np.int64)
            return out
        starts, firsts = self._offsets
        slot_globals = np.repeat(starts - firsts, np.diff(firsts, append=self.rows))
        slot_globals += np.arange(self.rows, dtype=np.int64)
        out = slot_globals[a:b].copy() if order is None else slot_globals[order]
        return out


@dataclass(frozen=True)
class EpochPlan:
    """What one rank serves in one epoch."""

    epoch: int
    n_samples: int  # samples of this rank's share
    chunks: tuple[ChunkPlan, ...]
    batch_size: int
    full_batches: int  # batches of batch_size rows, then `tail`
    tail: tuple[int, ...] = field(default=())

    @property
    def n_batches(self) -> int:
        return self.full_batches + len(self.tail)

    @property
    def n_served(self) -> int:
        """Samples actually yielded (less than ``n_samples`` with ``drop_last``)."""
        return self.full_batches * self.batch_size + sum(self.tail)

    def batch_sizes(self) -> Iterator[int]:
        """The sizes of the epoch's batches, in order."""
        for _ in range(self.full_batches):
            yield self.batch_size
        yield from self.tail


def shard_share(
    n: int, batch_size: int, rank: int, world_size: int, drop_last: bool = False
) -> tuple[int, int]:
    """``(start, size)`` of rank's share of an epoch's walk over ``n`` samples."""
    q, r = divmod(n, world_size * batch_size)
    if drop_last:
        return rank * q * batch_size, q * batch_size
    base, extra = divmod(r, world_size)
    start = rank * (q * batch_size + base) + min(rank, extra)
    return start, q * batch_size + base + (1 if rank < extra else 0)


def check_split(n: int, batch_size: int, world_size: int, drop_last: bool) -> None:
    """Raise :class:`ConfigurationError` when no rank can plan an epoch of ``n`` samples.

    Decided from values that are the same on every rank, so every rank raises, or none does:
    a rank that raised alone would leave the others blocked in their collectives.
    """
    if n < world_size:
        raise ConfigurationError(
            f"the data set has {n} samples, fewer than world_size={world_size}"
        )
    q, r = divmod(n, world_size * batch_size)
    if drop_last and q == 0:
        raise ConfigurationError(
            f"drop_last=True with batch_size={batch_size} leaves no batch: the source has {n} "
            f"samples, fewer than world_size x batch_size = {world_size * batch_size}"
        )
    if not drop_last and 0 < r < world_size and (q == 0 or batch_size == 1):
        raise ConfigurationError(
            f"{n} samples cannot be split over world_size={world_size} ranks with the same "
            f"number of batches at batch_size={batch_size} without repeating samples; use "
            "drop_last=True"
        )


def batch_layout(
    n: int, batch_size: int, rank: int, world_size: int, drop_last: bool
) -> tuple[int, tuple[int, ...]]:
    """A rank's full batches and the sizes of its batches after them, for ``n`` samples in all."""
    check_split(n, batch_size, world_size, drop_last)
    q, r = divmod(n, world_size * batch_size)
    if drop_last or r == 0:
        return q, ()
    mine = shard_share(n, batch_size, rank, world_size)[1] - q * batch_size
    if mine > 0:
        return q, (mine,)
    # Leftover smaller than world_size and none for this rank: split the last full batch
    # (check_split made sure there is one, of at least two rows).
    return q - 1, (batch_size - 1, 1)


def plan_epoch(
    n: int,
    *,
    epoch: int,
    batch_size: int,
    chunk_size: int,
    shuffle: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    first_rows: int | None = None,
    stream: bool = False,
    block_size: int | None = None,
    ramp_lanes: int = 1,
    chunk_lanes: int = 1,
    ramp_top_lanes: int | None = None,
    even_chunks: bool = False,
) -> EpochPlan:
    """Plan epoch ``epoch`` of rank ``rank`` over ``n`` samples. Pure and deterministic.

    ``block_size``: samples per block of the shuffled walk (``None``: one block, the whole ring,
    rotated: each chunk is then one contiguous stretch of it). With ``stream=True`` (for
    :meth:`AsyncHDF5DataLayer.stream`) the epoch is the rank's whole share, whatever
    ``drop_last``: stream batches are always full and wrap across epochs, so no sample is ever
    left out; the plan's batch counts are those of full batches.

    ``ramp_lanes`` (shuffled only): the first chunk is cut into that many *lanes*, equal
    stretches of its walk, and each piece of its ramp takes the same share of every lane, so
    that even the first piece draws from that many places of the data set (in one lane, the
    first pieces would hold a block or two: every epoch's first batches would come from a few
    places, which class-sorted data shows as batches of one class). ``ramp_top_lanes``: each
    piece after the first splits the lanes' rests in two, up to that many lanes, so that it
    draws from twice the places of the piece before with parts as large
    (:func:`~._walk.growing_ramp`); ``None``: the lanes stay ``ramp_lanes`` (:func:`~._walk.ramp`,
    the order of states saved before growing lanes).

    ``even_chunks`` (shuffled, without lanes, blocks shorter than a chunk): the share is cut
    into its ``ceil(size / chunk_size)`` chunks of equal sizes (within a row), not full chunks
    and a remainder: a remainder of a few thousand rows was one block, its batches of one class
    on class-sorted data (False: the cut of states saved before).

    ``chunk_lanes`` (shuffled only): the rank's share is dealt row by row to that many lanes,
    each a stretch of its walk, and each chunk takes ``chunk_size`` rows from every lane in turn
    (:class:`~._walk.Lanes`), so that a chunk draws from at least that many places of the data
    set however few blocks it holds (a cache shrunk to a small memory budget, blocks kept large
    for the disk); 1 is the plain cut.
    """
    tail: tuple[int, ...]
    if stream:
        if n < world_size:
            check_split(n, batch_size, world_size, False)
        start, size = shard_share(n, batch_size, rank, world_size)
        full, tail = size // batch_size, ()
    else:
        full, tail = batch_layout(n, batch_size, rank, world_size, drop_last)
        start, size = shard_share(n, batch_size, rank, world_size, drop_last)
    walk = Walk(n, epoch, seed, shuffle, block_size)

    # Each chunk: its stretches of walk positions, relative to the share's start (one, but for
    # the lanes of chunks and of the ramp), in a random order when shuffled: with blocks, the
    # chunks hold random blocks already; with one (the rotated ring, or a block_size beyond the
    # data) they are stretches of it.
    lanes = max(1, min(chunk_lanes, chunk_size, size)) if shuffle else 1
    laned = Lanes(walk, start, size, chunk_size, lanes) if lanes > 1 else None
    count = laned.count if laned is not None else -(-size // chunk_size)
    order = list(range(count))
    if shuffle:
        perm = np.random.default_rng(seed_tuple(seed, epoch, rank, 1)).permutation(count)
        order = perm.tolist()

    # (Blocks at least a chunk long: chunks are cut along them, each one stretch of a block.)
    even = shuffle and even_chunks and laned is None and (block_size or n) < chunk_size

    def stretches(k: int) -> list[tuple[int, int]]:
        if laned is not None:
            return laned.stretches(k)
        if even:
            return [(k * size // count, (k + 1) * size // count)]
        return [(k * chunk_size, min((k + 1) * chunk_size, size))]

    def ranges(parts: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        out: list[tuple[int, int]] = []
        for a, b in parts:
            for g0, g1 in walk.ranges(start + a, start + b):
                append_range(out, g0, g1)
        return tuple(out)

    chunks: list[ChunkPlan] = []

    def add(got: tuple[tuple[int, int], ...]) -> None:
        i = len(chunks)
        chunks.append(
            ChunkPlan(epoch, i, got, seed_tuple(seed, epoch, rank, 2, i) if shuffle else None)
        )

    for k in order:
        if not chunks and first_rows is not None:
            first = stretches(k)
            rows = sum(b - a for a, b in first)
            if rows > 2 * first_rows:  # the first chunk, read as a ramp of growing pieces
                if not shuffle or ramp_top_lanes is None:
                    for part in ramp(0, rows, first_rows, ramp_lanes if shuffle else 1):
                        add(ranges(within(first, part)))
                    continue
                # The lanes cut the chunk's rows in the order they are stored, so that the
                # pieces sample the part of the data set the chunk holds evenly (in walk
                # order, its random blocks: a lane's share of them is a random draw).
                stored = sorted(ranges(first))
                for part in growing_ramp(0, rows, first_rows, ramp_lanes, ramp_top_lanes):
                    got: list[tuple[int, int]] = []
                    for a, b in within(stored, part):
                        append_range(got, a, b)
                    add(tuple(got))
                continue
        add(laned.ranges(k) if laned is not None else ranges(stretches(k)))
    return EpochPlan(epoch, size, tuple(chunks), batch_size, full, tail)
