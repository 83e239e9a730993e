"""An epoch's walk over the samples, and how a rank's share of it is cut into chunks.

:class:`Walk`: the ring of samples, rotated by a random offset, cut into blocks and permuted
(``shuffle=True``), or walked from 0; every rank computes the same walk from ``(seed, epoch)``.
:class:`Lanes` and :func:`ramp`: a share's stretches of the walk dealt to lanes, so that a chunk
(or a ramp's piece) draws from many places of the data set. Pure: no I/O (see :mod:`._plan`).
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.random  # numpy imports it lazily: not on the event loop at the first plan

__all__ = [
    "Lanes",
    "Walk",
    "append_range",
    "global_ranges",
    "growing_ramp",
    "ramp",
    "ramp_sizes",
    "seed_tuple",
    "within",
]


def seed_tuple(seed: int, epoch: int, *more: int) -> tuple[int, ...]:
    return (seed, epoch, *more)


class Walk:
    """An epoch's walk over the ring: the blocks in order, as global ranges per position."""

    def __init__(
        self, n: int, epoch: int, seed: int, shuffle: bool, block_size: int | None
    ) -> None:
        self.n = n
        if not shuffle:
            self.starts = np.zeros(1, np.int64)
            self.lengths = np.array([n], np.int64)
        else:
            rng = np.random.default_rng(seed_tuple(seed, epoch))
            offset = int(rng.integers(n))
            block = max(1, min(n, block_size or n))
            nblocks = -(-n // block)
            lengths = np.full(nblocks, block, np.int64)
            lengths[-1] = n - block * (nblocks - 1)
            starts = (offset + np.arange(nblocks, dtype=np.int64) * block) % n
            if nblocks > 1:  # (one block: nothing to permute, and no generator to seed)
                perm = np.random.default_rng(seed_tuple(seed, epoch, 0)).permutation(nblocks)
                starts, lengths = starts[perm], lengths[perm]
            self.starts, self.lengths = starts, lengths
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
                append_range(out, g0, g1)
            else:
                append_range(out, g0, self.n)
                append_range(out, 0, g1 - self.n)
            pos += hi - lo
            i += 1
        return tuple(out)


def append_range(out: list[tuple[int, int]], a: int, b: int) -> None:
    if out and out[-1][1] == a:  # neighbours join: one read
        out[-1] = (out[-1][0], b)
    else:
        out.append((a, b))


class Lanes:
    """A rank's share of the walk (``size`` positions from ``start``) dealt to ``lanes`` lanes
    row by row (position ``p`` to lane ``p % lanes``; each lane is then one stretch of the
    walk), and cut into chunks of ``chunk_size`` dealt rows: chunk ``k`` takes, from every
    lane, the stretch of its rows dealt while positions ``k * chunk_size`` to ``(k + 1) *
    chunk_size`` were. So every chunk holds exactly ``chunk_size`` rows (the last, the rest),
    taken from ``lanes`` places of the walk, and the chunks together hold every row once.

    Computed for all chunks at once with NumPy: a small cache over a large data set makes
    thousands of chunks of hundreds of parts each.
    """

    def __init__(self, walk: Walk, start: int, size: int, chunk_size: int, lanes: int) -> None:
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
        g0, g1, chunk = global_ranges(
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


def global_ranges(
    walk: Walk, x: np.ndarray, y: np.ndarray, chunk: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`Walk.ranges` of every part ``x[i]:y[i]`` at once: the global ranges, in part
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


def within(stretches: list[tuple[int, int]], part: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``part`` (positions within the concatenation of ``stretches``) as positions of the
    stretches themselves. Linear in both when ``part`` is sorted (a ramp's pieces are: a first
    chunk of hundreds of lane stretches cut into a ramp took tens of ms quadratically)."""
    out: list[tuple[int, int]] = []
    firsts = list(itertools.accumulate((b - a for a, b in stretches), initial=0))
    i = 0
    for x, y in part:
        if i and x < firsts[i]:  # not sorted: start over (never for a ramp's pieces)
            i = 0
        while i < len(stretches) and firsts[i + 1] <= x:
            i += 1
        j = i
        while j < len(stretches) and firsts[j] < y:
            a = stretches[j][0]
            lo, hi = max(x, firsts[j]), min(y, firsts[j + 1])
            if lo < hi:
                append_range(out, a + lo - firsts[j], a + hi - firsts[j])
            j += 1
    return out


def ramp_sizes(rows: int, first_rows: int) -> list[int]:
    """The sizes of a ramp's pieces over ``rows`` rows: ``first_rows``, twice that, and so on,
    the last taking the rest (at least twice the piece before it)."""
    sizes = []
    step, rest = first_rows, rows
    while rest > 2 * step:
        sizes.append(step)
        rest -= step
        step *= 2
    sizes.append(rest)
    return sizes


def ramp(a: int, b: int, first_rows: int, lanes: int) -> list[list[tuple[int, int]]]:
    """Walk positions ``a:b`` cut into pieces of about ``first_rows``, then twice that, and so
    on (the last takes the rest); each piece takes the same share of every one of ``lanes``
    equal stretches of ``a:b`` (so every piece is spread over all of them). The ramp of states
    saved before :func:`growing_ramp`."""
    sizes = ramp_sizes(b - a, first_rows)
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


def growing_ramp(
    a: int, b: int, first_rows: int, lanes: int, top_lanes: int
) -> list[list[tuple[int, int]]]:
    """Walk positions ``a:b`` cut into the pieces of :func:`ramp_sizes`, each piece spread over
    more places than the one before: the first takes equal shares of ``lanes`` equal stretches
    of ``a:b``, and each next piece, twice as large, first splits every stretch's rest in two
    (up to ``top_lanes`` stretches), so that its parts stay as large as the first piece's while
    it draws from twice as many places. (With lanes fixed, a piece of a ramp drew from as few
    places as the first, and the first hundred batches of every epoch mixed less than the
    rest.) Every position is in exactly one piece: each takes the front of every stretch's
    rest, and the last takes all that is left. Parts in each piece are in position order."""
    sizes = ramp_sizes(b - a, first_rows)
    lanes = max(1, min(lanes, first_rows // 2))  # each piece: more rows than lanes
    top_lanes = max(lanes, top_lanes)
    total = b - a
    rest = [(a + total * s // lanes, a + total * (s + 1) // lanes) for s in range(lanes)]
    out: list[list[tuple[int, int]]] = []
    for k, size in enumerate(sizes):
        if k and 2 * len(rest) <= top_lanes:
            rest = [h for x, y in rest for h in ((x, (x + y) // 2), ((x + y) // 2, y))]
        left = sum(y - x for x, y in rest)
        take = min(size, left) if k < len(sizes) - 1 else left
        parts, kept, before = [], [], 0
        for x, y in rest:
            # This stretch's share of the piece, in proportion to its rest (exactly `take`).
            lo = take * before // left
            before += y - x
            got = take * before // left - lo
            if got:
                parts.append((x, x + got))
            if x + got < y:
                kept.append((x + got, y))
        rest = kept
        out.append(parts)
    return out
