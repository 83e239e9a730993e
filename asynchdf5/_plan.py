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
    chunk_lanes: int = 1,
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

    ``chunk_lanes`` (shuffled only): the rank's share is cut into that many lanes, equal
    stretches of its walk, and each chunk takes the same share of every lane, so that a chunk
    draws from at least that many places of the data set however few blocks it holds (a cache
    shrunk to a small memory budget, blocks kept large for the disk). Chunks then hold at most
    ``chunk_size`` rows each (their lanes' shares are rounded); 1 is the plain cut.
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

    # Each chunk: its stretches of walk positions, relative to the share's start (one, but for
    # the lanes of chunks and of the ramp), in a random order when shuffled: with blocks, the
    # chunks hold random blocks already; with one (the rotated ring, or a block_size beyond the
    # data) they are stretches of it.
    lanes = max(1, min(chunk_lanes, chunk_size, size)) if shuffle else 1
    laned = _Lanes(walk, start, size, chunk_size, lanes) if lanes > 1 else None
    count = laned.count if laned is not None else -(-size // chunk_size)
    order = list(range(count))
    if shuffle:
        perm = np.random.default_rng(_seed_tuple(seed, epoch, rank, 1)).permutation(count)
        order = perm.tolist()

    def stretches(k: int) -> list[tuple[int, int]]:
        if laned is not None:
            return laned.stretches(k)
        return [(k * chunk_size, min((k + 1) * chunk_size, size))]

    def ranges(parts: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        out: list[tuple[int, int]] = []
        for a, b in parts:
            for g0, g1 in walk.ranges(start + a, start + b):
                _append(out, g0, g1)
        return tuple(out)

    chunks: list[ChunkPlan] = []
    for k in order:
        i = len(chunks)
        chunk_seed = _seed_tuple(seed, epoch, rank, 2, i) if shuffle else None
        if i == 0 and first_rows is not None:
            first = stretches(k)
            rows = sum(b - a for a, b in first)
            if rows > 2 * first_rows:  # the first chunk, read as a ramp of growing pieces
                for part in _ramp(0, rows, first_rows, ramp_lanes if shuffle else 1):
                    i = len(chunks)
                    chunk_seed = _seed_tuple(seed, epoch, rank, 2, i) if shuffle else None
                    chunks.append(ChunkPlan(epoch, i, ranges(_within(first, part)), chunk_seed))
                continue
        got = laned.ranges(k) if laned is not None else ranges(stretches(k))
        chunks.append(ChunkPlan(epoch, i, got, chunk_seed))
    return EpochPlan(epoch, size, tuple(chunks), batch_size, full, tail)


class _Lanes:
    """A rank's share of the walk (``size`` positions from ``start``) dealt to ``lanes`` lanes
    row by row (position ``p`` to lane ``p % lanes``; each lane is then one stretch of the
    walk), and cut into chunks of ``chunk_size`` dealt rows: chunk ``k`` takes, from every
    lane, the stretch of its rows dealt while positions ``k * chunk_size`` to ``(k + 1) *
    chunk_size`` were. So every chunk holds exactly ``chunk_size`` rows (the last, the rest),
    taken from ``lanes`` places of the walk, and the chunks together hold every row once.

    Computed for all chunks at once with NumPy: a small cache over a large data set makes
    thousands of chunks of hundreds of parts each.
    """

    def __init__(self, walk: _Walk, start: int, size: int, chunk_size: int, lanes: int) -> None:
        lane = np.arange(lanes, dtype=np.int64)
        lens = (size - lane + lanes - 1) // lanes  # rows of each lane
        first = np.cumsum(lens) - lens  # its first position
        self.count = -(-size // chunk_size)
        m0 = np.arange(self.count, dtype=np.int64)[:, None] * chunk_size
        m1 = np.minimum(m0 + chunk_size, size)
        # Rows of lane l dealt among the first m positions: ceil((m - l) / lanes), or 0.
        x = first + np.minimum((m0 - lane + lanes - 1) // lanes, lens)
        y = first + np.minimum((m1 - lane + lanes - 1) // lanes, lens)
        keep = x < y
        self.x, self.y = x[keep], y[keep]  # chunk-major, lanes in order
        per_chunk = keep.sum(axis=1)
        self.parts = np.concatenate(([0], np.cumsum(per_chunk)))  # chunk k: parts[k]:parts[k+1]
        g0, g1, chunk = _global(
            walk, self.x + start, self.y + start, np.repeat(np.arange(self.count), per_chunk)
        )
        self.g0, self.g1 = g0.tolist(), g1.tolist()
        self.bounds = np.searchsorted(chunk, np.arange(self.count + 1)).tolist()

    def stretches(self, k: int) -> list[tuple[int, int]]:
        """Chunk ``k``'s stretches, as walk positions relative to the share's start."""
        a, b = self.parts[k], self.parts[k + 1]
        return list(zip(self.x[a:b].tolist(), self.y[a:b].tolist(), strict=True))

    def ranges(self, k: int) -> tuple[tuple[int, int], ...]:
        """Chunk ``k``'s global ranges, neighbours joined."""
        a, b = self.bounds[k], self.bounds[k + 1]
        return tuple(zip(self.g0[a:b], self.g1[a:b], strict=True))


def _global(
    walk: _Walk, x: np.ndarray, y: np.ndarray, chunk: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`_Walk.ranges` of every part ``x[i]:y[i]`` at once: the global ranges, in part
    order, neighbours of the same chunk joined, with the chunk of each."""
    n = walk.n
    pieces = []
    pos, end, part = x, y, np.arange(len(x), dtype=np.int64)
    step = 0
    while len(pos):
        i = np.searchsorted(walk.firsts, pos, side="right") - 1
        stop = np.minimum(end, walk.firsts[i] + walk.lengths[i])  # to the end of the block
        g0 = (walk.starts[i] + pos - walk.firsts[i]) % n
        g1 = g0 + (stop - pos)
        wraps = g1 > n  # the ring wraps inside the block: two ranges
        pieces.append((part, np.full(len(part), step), g0, np.minimum(g1, n)))
        pieces.append(
            (part[wraps], np.full(int(wraps.sum()), step + 1), 0 * g0[wraps], g1[wraps] - n)
        )
        step += 2
        more = stop < end
        pos, end, part = stop[more], end[more], part[more]
    p, s, g0, g1 = (np.concatenate(c) for c in zip(*pieces, strict=True))
    sort = np.lexsort((s, p))
    p, g0, g1 = p[sort], g0[sort], g1[sort]
    c = chunk[p]
    joins = np.zeros(len(p), bool)
    joins[1:] = (g0[1:] == g1[:-1]) & (c[1:] == c[:-1])
    heads = np.flatnonzero(~joins)
    tails = np.append(heads[1:], len(p)) - 1
    return g0[heads], g1[tails], c[heads]


def _within(stretches: list[tuple[int, int]], part: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``part`` (positions within the concatenation of ``stretches``) as positions of the
    stretches themselves."""
    out: list[tuple[int, int]] = []
    for x, y in part:
        first = 0
        for a, b in stretches:
            lo, hi = max(x, first), min(y, first + b - a)
            if lo < hi:
                _append(out, a + lo - first, a + hi - first)
            first += b - a
    return out


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
