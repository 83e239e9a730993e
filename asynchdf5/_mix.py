"""Mixing streams: the plan of an epoch over several named streams. Pure: no I/O.

A stream is a contiguous range of global rows (its files, in the one catalog of every stream)
that gives ``count`` samples per epoch. They come from its own endless walk: pass ``j`` is the
block-mixed walk of its rows (:class:`~._walk.Walk`) drawn from the stream's seed and ``j``, and
epoch ``e`` takes positions ``e * count`` to ``(e + 1) * count`` of the passes laid end to end.
So a stream below its size walks through one pass over several epochs (every sample before any
repeats), one above it repeats whole passes and then part of one, and one at its size serves
pass ``e`` in epoch ``e``: exactly once.

The epoch is ``T`` positions (the counts' sum), cut into ranks' shares and batches
(*windows*), each window with a count of every stream, the same on every rank
(:func:`~._shares.epoch_table`: stratified, random or per stream). Within a window, each
stream's rows are spread evenly among the others'.

Each chunk of a rank's share reads, for every stream, the stretch of its walk that the chunk's
windows take (so every chunk reads from every stream: none waits for another's reads), its
blocks read whole, and serves each stream's rows in a random order within the chunk and within
each pass (a pass ends before the next begins).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.random  # numpy imports it lazily: not on the event loop at the first plan

from ._plan import ChunkPlan, EpochPlan, check_split
from ._shares import SALT, epoch_table
from ._walk import Walk, append_range, global_ranges, ramp, seed_tuple, within

__all__ = ["StreamRows", "plan_mixed", "stream_seed", "window_labels"]


@dataclass(frozen=True)
class StreamRows:
    """One stream as the planner sees it: its rows ``start:start + size`` of the catalog, and
    the samples it gives per epoch. ``tops``: ``(top, internal top)`` pairs of a stream whose
    tops differ from another's in dtype or shape (:mod:`._schemas`); () when the streams
    agree."""

    name: str
    start: int
    size: int
    count: int
    tops: tuple[tuple[str, str], ...] = ()


def stream_seed(seed: int, stream: int) -> int:
    """The seed of a stream's walks: its own, so that two streams of the same size differ."""
    state = np.random.SeedSequence((seed, SALT, stream)).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))


def window_labels(table: np.ndarray, bounds: np.ndarray, a: int, b: int) -> np.ndarray:
    """The stream of each position ``a:b`` of a share whose windows have ``table`` counts and
    start at ``bounds``: within a window, stream ``s``'s ``i``-th row sits at ``(i + 1/2) /
    count`` of it (ties: the lower stream first), so each stream is spread evenly over the
    window. A window's arrangement depends on its counts alone: each distinct row of counts is
    arranged once, and the windows gather theirs (stratified windows share a few)."""
    wa = int(np.searchsorted(bounds, a, side="right")) - 1
    wb = int(np.searchsorted(bounds, b, side="left"))
    part = table[wa:wb]
    if len(part) == 1:  # one window (a chunk's bound): no kinds to find
        kinds, which = part, np.zeros(1, np.int64)
    else:
        kinds, which = np.unique(part, axis=0, return_inverse=True)
    arranged, firsts = _arrange(kinds)
    lens = part.sum(axis=1)
    starts = np.cumsum(lens) - lens
    at = np.repeat(firsts[which.reshape(-1)] - starts, lens) + np.arange(int(lens.sum()))
    labels = arranged[at]
    base = int(bounds[wa])
    return labels[a - base : b - base]


def _arrange(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of counts arranged (see :func:`window_labels`), concatenated, and where each
    starts. Exact: the positions are compared as integers ``(2 i + 1) * 2**31 // (2 count)``,
    which are the same whichever rows are arranged together."""
    n, k = kinds.shape
    flat = kinds.ravel()
    stream = np.repeat(np.tile(np.arange(k), n), flat)
    row = np.repeat(np.repeat(np.arange(n, dtype=np.int64), k), flat)
    i = np.arange(len(stream), dtype=np.int64) - np.repeat(np.cumsum(flat) - flat, flat)
    key = (2 * i + 1) * 2**31 // (2 * np.repeat(flat, flat)) + (row << 32)
    lens = kinds.sum(axis=1)
    return stream[np.argsort(key, kind="stable")], np.cumsum(lens) - lens


@dataclass(frozen=True, eq=False)
class _Order:
    """A mixed chunk's serving order (:attr:`~._plan.ChunkPlan.arrange`): its positions
    ``a:b`` of the share take each stream's rows, which lie in the slot one stream after the
    other, in a random order within each pass (``seed``; ``None``: in walk order)."""

    table: np.ndarray
    bounds: np.ndarray
    a: int
    b: int
    first: tuple[int, ...]  # each stream's first position of its passes in the chunk
    last: tuple[int, ...]
    sizes: tuple[int, ...]  # each stream's rows (its passes' length)
    seed: tuple[int, ...] | None

    def __call__(self) -> np.ndarray:
        labels = window_labels(self.table, self.bounds, self.a, self.b)
        order = np.empty(self.b - self.a, np.int64)
        rng = None if self.seed is None else np.random.default_rng(self.seed)
        offset = 0
        for s, (x, y, size) in enumerate(zip(self.first, self.last, self.sizes, strict=True)):
            n = y - x
            if n == 0:
                continue
            perm = np.arange(offset, offset + n, dtype=np.int64)
            if rng is not None:
                cuts = range(-(-x // size) * size - x, n, size)  # where a pass ends
                for lo, hi in itertools.pairwise((0, *cuts, n)):
                    rng.shuffle(perm[lo:hi])
            order[labels == s] = perm
            offset += n
        return order


def _take(stretches: list[tuple[int, int]], a: int, b: int, lanes: int) -> list[tuple[int, int]]:
    """The rows dealt ``a:b`` of the concatenation of ``stretches`` dealt to ``lanes`` lanes
    row by row (the ``m``-th row dealt to lane ``m % lanes``, each lane an equal stretch of the
    concatenation, as :class:`~._walk.Lanes` deals them), as stretches: exactly ``b - a`` rows,
    taken from every lane."""
    n = sum(y - x for x, y in stretches)
    lanes = max(1, min(lanes, n))
    if lanes == 1:
        return within(stretches, [(a, b)])
    parts = []
    for lane in range(lanes):
        first = lane * (n // lanes) + min(lane, n % lanes)  # lane l's first row
        lo = max(0, -(-(a - lane) // lanes))
        hi = max(0, -(-(b - lane) // lanes))
        if lo < hi:
            parts.append((first + lo, first + hi))
    return within(stretches, parts)


def _laned(
    walk: Walk, offset: int, n: int, lanes: int, a: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_take` of the walk positions ``offset:offset + n`` for every chunk at once: the
    rows dealt ``a[i]:b[i]`` of chunk ``i``, as global ranges (of the walk's ring), chunk by
    chunk, each chunk's in lane order: ``(starts, stops, chunks)``. Vectorised, as
    :class:`~._walk.Lanes` is: a small cache makes thousands of chunks of many lanes."""
    lanes = max(1, min(lanes, n))
    lane = np.arange(lanes, dtype=np.int64)
    lens = (n - lane + lanes - 1) // lanes
    first = np.cumsum(lens) - lens
    x = first + np.clip((a[:, None] - lane + lanes - 1) // lanes, 0, lens)
    y = first + np.clip((b[:, None] - lane + lanes - 1) // lanes, 0, lens)
    keep = x < y
    if not keep.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    chunk = np.broadcast_to(np.arange(len(a))[:, None], x.shape)[keep]
    return global_ranges(walk, x[keep] + offset, y[keep] + offset, chunk)


def _cut(size: int, chunk_size: int, first_rows: int | None) -> tuple[list[int], int]:
    """The chunk bounds of a share of ``size`` positions: the first chunk ramped up from
    ``first_rows`` (as :func:`~._plan.plan_epoch` does), then chunks of ``chunk_size``; and
    the pieces of the ramp (0: not ramped)."""
    if size == 0:
        return [0], 0
    first = min(chunk_size, size)
    cuts = [0]
    pieces = 0
    if first_rows is not None and first > 2 * first_rows:
        cuts += [piece[-1][1] for piece in ramp(0, first, first_rows, 1)]
        pieces = len(cuts) - 1
    else:
        cuts.append(first)
    cuts += list(range(first + chunk_size, size, chunk_size))
    if cuts[-1] != size:
        cuts.append(size)
    return cuts, pieces


def plan_mixed(
    streams: Sequence[StreamRows],
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
    mode: str = "stratified",
    ramp_lanes: int = 1,
    chunk_lanes: int = 1,
) -> EpochPlan:
    """Plan epoch ``epoch`` of rank ``rank`` over ``streams`` (see the module's docstring).
    Pure and deterministic; the same arguments as :func:`~._plan.plan_epoch`.

    ``chunk_lanes`` (shuffled only): each stream's rows of the share are dealt row by row to
    its share of that many lanes (within each pass), and each chunk takes its rows of the
    stream from every lane, as :func:`~._plan.plan_epoch` does for one source.
    ``ramp_lanes`` (shuffled only): each stream's part of the first chunk is dealt so again,
    and each piece of the ramp takes its rows of the stream from every lane, so that the first
    batches draw from as many places of every stream (where that part lies within one pass of
    the stream: a pass ends before the next begins)."""
    counts = tuple(s.count for s in streams)
    total = sum(counts)
    if mode != "per_stream" and (not stream or total < world_size):
        check_split(total, batch_size, world_size, drop_last and not stream)
    names = tuple(s.name for s in streams)
    lens, firsts, table = epoch_table(
        counts, names, batch_size, world_size, drop_last, stream, mode, shuffle, seed, epoch
    )
    w0, w1 = firsts[rank], firsts[rank + 1]
    mine = table[w0:w1]
    bounds = np.concatenate(([0], np.cumsum(lens[w0:w1])))
    size = int(bounds[-1])
    done = np.cumsum(mine, axis=0) - mine  # each stream's rows before each window
    # Each stream's first position of its passes in this share.
    base = np.array(counts, np.int64) * epoch + table[:w0].sum(axis=0)

    def at(p: int) -> np.ndarray:
        """Each stream's rows among the share's first ``p`` positions."""
        if p >= size:
            return np.asarray(mine.sum(axis=0))
        w = int(np.searchsorted(bounds, p, side="right")) - 1
        head = window_labels(mine, bounds, int(bounds[w]), p)
        return np.asarray(done[w] + np.bincount(head, minlength=len(streams)))

    walks: dict[tuple[int, int], Walk] = {}
    seeds = [stream_seed(seed, s) for s in range(len(streams))]

    def walk_of(s: int, j: int) -> Walk:
        walk = walks.get((s, j))
        if walk is None:
            walk = walks[(s, j)] = Walk(streams[s].size, j, seeds[s], shuffle, block_size)
        return walk

    def ranges(s: int, x: int, y: int, out: list[tuple[int, int]]) -> None:
        """Stream ``s``'s positions ``x:y`` (of its passes) as global ranges, into ``out``."""
        n, start = streams[s].size, streams[s].start
        while x < y:
            j = x // n
            lo, hi = x - j * n, min(y - j * n, n)
            for g0, g1 in walk_of(s, j).ranges(lo, hi):
                append_range(out, g0 + start, g1 + start)
            x += hi - lo

    # Each stream's rows of this share, cut where its passes end: (first row dealt, first
    # position, rows). Within each, its rows are dealt to lanes (shuffled: its share of
    # `chunk_lanes`, so that a lane's part of a chunk is as long as one source's), and each
    # chunk takes its rows of the stream from every lane: a pass ends before the next begins.
    lanes = [-(-chunk_lanes * c // total) if shuffle else 1 for c in counts]
    spans: list[list[tuple[int, int, int]]] = []
    for s, (x, rows) in enumerate(zip(base.tolist(), mine.sum(axis=0).tolist(), strict=True)):
        n, p, here = streams[s].size, x, []
        while p < x + rows:
            q = min(x + rows, (p // n + 1) * n)
            here.append((p - x, p, q - p))
            p = q
        spans.append(here)
    heads = [[u for u, _, _ in here] for here in spans]

    def part(s: int, d0: int, d1: int, lanes: int) -> list[tuple[int, int]]:
        """Stream ``s``'s rows dealt ``d0:d1`` of this share, as stretches of its passes."""
        out: list[tuple[int, int]] = []
        k = max(0, bisect.bisect_right(heads[s], d0) - 1)
        for u, x, n in spans[s][k:]:
            if u >= d1:
                break
            a, b = max(d0, u) - u, min(d1, u + n) - u
            if a < b:
                out += _take([(x, x + n)], a, b, lanes)
        return out

    cuts, pieces = _cut(size, chunk_size, first_rows)
    marks = [base + at(p) for p in cuts]
    dealt = np.array(marks, np.int64) - base  # each cut's rows dealt of every stream
    sizes = tuple(s.size for s in streams)
    # The chunks' ranges of each stream, all chunks at once (pieces of a ramp taken from
    # ramp_lanes places of the first chunk: below).
    laned: list[list[list[tuple[int, int]]]] = [[[] for _ in cuts] for _ in streams]
    for s, stream_spans in enumerate(spans):
        # A stretch that one chunk takes whole (most passes of a small upsampled stream) is
        # its walk's ranges in order, whatever the lanes: no per-chunk work for it.
        us = np.array([u for u, _, _ in stream_spans], np.int64)
        ns = np.array([n for _, _, n in stream_spans], np.int64)
        ks = np.searchsorted(dealt[:, s], us, side="right") - 1
        alone = (ks < len(cuts) - 1) & (us + ns <= dealt[np.minimum(ks + 1, len(cuts) - 1), s])
        for (u, x, n), k, whole in zip(stream_spans, ks.tolist(), alone.tolist(), strict=True):
            if whole:
                j = x // sizes[s]
                g = walk_of(s, j).ranges(x - j * sizes[s], x - j * sizes[s] + n)
                laned[s][k] += [(a + streams[s].start, b + streams[s].start) for a, b in g]
                continue
            lo = np.clip(dealt[:-1, s] - u, 0, n)
            hi = np.clip(dealt[1:, s] - u, 0, n)
            j = x // sizes[s]
            g0, g1, c = _laned(walk_of(s, j), x - j * sizes[s], n, lanes[s], lo, hi)
            g0 += streams[s].start
            g1 += streams[s].start
            ends = np.searchsorted(c, np.arange(len(cuts)))
            for k, (e0, e1) in enumerate(itertools.pairwise(ends.tolist())):
                if e0 < e1:
                    laned[s][k] += zip(g0[e0:e1].tolist(), g1[e0:e1].tolist(), strict=True)
    chunks: list[ChunkPlan] = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        first, last = marks[i], marks[i + 1]
        got: list[tuple[int, int]] = []
        for s in range(len(streams)):
            d0, d1 = int(first[s] - base[s]), int(last[s] - base[s])
            head = int(marks[pieces][s] - base[s]) if pieces else 0  # the first chunk's rows
            if i < pieces and ramp_lanes > 1 and len(part(s, 0, head, 1)) <= 1:
                # A piece of the ramp, within one pass: from ramp_lanes places of the chunk.
                for x, y in _take(part(s, 0, head, lanes[s]), d0, d1, ramp_lanes):
                    ranges(s, x, y, got)
            elif laned[s][i]:
                append_range(got, *laned[s][i][0])  # joins its neighbour
                got += laned[s][i][1:]
        order = _Order(
            mine,
            bounds,
            a,
            b,
            tuple(first.tolist()),
            tuple(last.tolist()),
            sizes,
            seed_tuple(seed, epoch, rank, SALT, i) if shuffle else None,
        )
        chunks.append(ChunkPlan(epoch, i, tuple(got), None, arrange=order))
    # The rank's batches: its full windows, then the shorter ones (the way both tables end).
    sizes_ = lens[w0:w1]
    short = np.flatnonzero(sizes_ != batch_size)
    full = int(short[0]) if len(short) else len(sizes_)
    tail = tuple(sizes_[full:].tolist())
    if stream:
        full, tail = size // batch_size, ()
    return EpochPlan(epoch, size, tuple(chunks), batch_size, full, tail)
