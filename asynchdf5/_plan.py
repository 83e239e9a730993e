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
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.random  # numpy imports it lazily: not on the event loop at the first plan

from ._errors import ConfigurationError

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
        if self.seed is None:
            return None if self.serve is None else np.arange(*self.serve, dtype=np.int64)
        # The same permutation as ``Generator.permutation(rows)``, but shuffling an arange in
        # place releases the GIL and is ~2x faster: for 2**20 rows 63 ms with no event-loop gap
        # over 2.3 ms, against 120 ms holding the GIL in 15 ms stretches (measured here).
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
        a ``take`` per sample (a binary search over the ranges per sample cost 0.15 CPU s a
        streaming epoch of the 4M-row tabular benchmark set)."""
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


def _seed_tuple(seed: int, epoch: int, *more: int) -> tuple[int, ...]:
    return (seed, epoch, *more)


class _Walk:
    """An epoch's walk over the ring: the blocks in order, as global ranges per position."""

    def __init__(
        self, n: int, epoch: int, seed: int, shuffle: bool, block_size: int | None
    ) -> None:
        self.n = n
        if not shuffle:
            self.starts = np.zeros(1, np.int64)
            self.lengths = np.array([n], np.int64)
        else:
            rng = np.random.default_rng(_seed_tuple(seed, epoch))
            offset = int(rng.integers(n))
            block = max(1, min(n, block_size or n))
            nblocks = -(-n // block)
            lengths = np.full(nblocks, block, np.int64)
            lengths[-1] = n - block * (nblocks - 1)
            starts = (offset + np.arange(nblocks, dtype=np.int64) * block) % n
            perm = np.random.default_rng(_seed_tuple(seed, epoch, 0)).permutation(nblocks)
            self.starts, self.lengths = starts[perm], lengths[perm]
        self.firsts = np.cumsum(self.lengths) - self.lengths  # walk position of each block

    def ranges(self, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """The global ranges of walk positions ``a:b`` (split where the ring wraps)."""
        out: list[tuple[int, int]] = []
        i = int(np.searchsorted(self.firsts, a, side="right")) - 1
        pos = a
        while pos < b:
            first, length = int(self.firsts[i]), int(self.lengths[i])
            lo = pos - first
            hi = min(length, b - first)
            g0 = (int(self.starts[i]) + lo) % self.n
            g1 = g0 + (hi - lo)
            if g1 <= self.n:
                _append(out, g0, g1)
            else:
                _append(out, g0, self.n)
                _append(out, 0, g1 - self.n)
            pos += hi - lo
            i += 1
        return tuple(out)


def _append(out: list[tuple[int, int]], a: int, b: int) -> None:
    if out and out[-1][1] == a:  # neighbours join: one read
        out[-1] = (out[-1][0], b)
    else:
        out.append((a, b))


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
    places, which class-sorted data shows as batches of one class).
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
    walk = _Walk(n, epoch, seed, shuffle, block_size)

    # Chunk boundaries on this rank's share, walk positions relative to the share's start.
    pieces = [(a, min(a + chunk_size, size)) for a in range(0, size, chunk_size)]
    if shuffle:
        # With blocks, the chunks hold random blocks already; with one (the rotated ring, or a
        # block_size beyond the data) they are stretches of it: either way, a random order.
        perm = np.random.default_rng(_seed_tuple(seed, epoch, rank, 1)).permutation(len(pieces))
        pieces = [pieces[int(i)] for i in perm]
    # Each chunk: its stretches of the walk (one, but for the ramp's lanes).
    stretches = [[piece] for piece in pieces]
    if first_rows is not None and pieces and pieces[0][1] - pieces[0][0] > 2 * first_rows:
        stretches[:1] = _ramp(*pieces[0], first_rows, ramp_lanes if shuffle else 1)

    chunks = []
    for i, parts in enumerate(stretches):
        chunk_seed = _seed_tuple(seed, epoch, rank, 2, i) if shuffle else None
        ranges: list[tuple[int, int]] = []
        for a, b in parts:
            for g0, g1 in walk.ranges(start + a, start + b):
                _append(ranges, g0, g1)
        chunks.append(ChunkPlan(epoch, i, tuple(ranges), chunk_seed))
    return EpochPlan(epoch, size, tuple(chunks), batch_size, full, tail)


def _ramp(a: int, b: int, first_rows: int, lanes: int) -> list[list[tuple[int, int]]]:
    """Walk positions ``a:b`` cut into pieces of about ``first_rows``, then twice that, and so
    on (the last takes the rest); each piece takes the same share of every one of ``lanes``
    equal stretches of ``a:b`` (so every piece is spread over all of them)."""
    sizes = []
    step, rest = first_rows, b - a
    while rest > 2 * step:
        sizes.append(step)
        rest -= step
        step *= 2
    sizes.append(rest)
    total = b - a
    lanes = max(1, min(lanes, first_rows // 2))  # each piece: more rows than lanes
    bounds = [a + total * s // lanes for s in range(lanes + 1)]
    out: list[list[tuple[int, int]]] = []
    done = 0
    for size in sizes:
        parts = []
        for lo, hi in itertools.pairwise(bounds):
            # This piece's share of the lane: from `done` to `done + size` of `total`, scaled.
            x = lo + (hi - lo) * done // total
            y = lo + (hi - lo) * (done + size) // total
            if x < y:
                parts.append((x, y))
        done += size
        out.append(parts)
    return out
