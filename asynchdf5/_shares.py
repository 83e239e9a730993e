"""How each batch is made of the streams: an epoch's *windows* (every batch of every rank, in
rank order) and each window's count of every stream (:func:`epoch_table`). Pure: no I/O.

``"stratified"``: a full batch holds ``floor(B * count / T)`` of each stream or one more, so
that the counts over the epoch are exact; ``"random"``: the counts of a random arrangement of
the epoch's samples; ``"per_stream"``: every batch of one stream (each stream's samples cut
into batches and shared over the ranks as one source's are; a rank's batches interleaved).
:mod:`._mix` turns a rank's windows into chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import numpy.random  # numpy imports it lazily: not on the event loop at the first plan

from ._errors import ConfigurationError
from ._plan import batch_layout, shard_share
from ._walk import seed_tuple

__all__ = ["BATCH_MODES", "SALT", "allocate", "epoch_table", "per_stream", "windows"]

#: The ways a batch is made of the streams (the ``batch_mode`` property).
BATCH_MODES = ("stratified", "random", "per_stream")

#: Mixed into every seed drawn for streams, so that their draws differ from the plain plan's.
SALT = 33


def _layout(
    n: int, batch_size: int, rank: int, world_size: int, drop_last: bool, stream: bool
) -> tuple[int, tuple[int, ...]]:
    """A rank's full batches and the sizes of its batches after them, for ``n`` samples
    (:func:`~._plan.batch_layout`); ``stream``: its whole share, whatever ``drop_last``."""
    if not stream:
        return batch_layout(n, batch_size, rank, world_size, drop_last)
    _, size = shard_share(n, batch_size, rank, world_size)
    full, rest = divmod(size, batch_size)
    return full, ((rest,) if rest else ())


def windows(
    total: int, batch_size: int, world_size: int, drop_last: bool, stream: bool
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Every batch of every rank of an epoch of ``total`` samples, in rank order, as lengths
    (and, with ``drop_last``, the leftover as a last window of no rank); and the index of each
    rank's first window, then the end of the last rank's."""
    parts: list[np.ndarray] = []
    firsts = [0]
    for rank in range(world_size):
        full, tail = _layout(total, batch_size, rank, world_size, drop_last, stream)
        parts.append(np.full(full, batch_size, np.int64))
        parts.append(np.array(tail, np.int64))
        firsts.append(firsts[-1] + full + len(tail))
    lens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    left = total - int(lens.sum())
    if left:
        lens = np.append(lens, left)
    return lens, tuple(firsts)


def allocate(
    counts: np.ndarray, lens: np.ndarray, batch_size: int, mode: str, rng: np.random.Generator
) -> np.ndarray:
    """Each window's count of every stream (windows x streams): row ``i`` sums to ``lens[i]``,
    column ``s`` to ``counts[s]``.

    ``"stratified"``: a window of ``batch_size`` rows holds ``floor(batch_size * count / T)``
    or one more of every stream, the windows holding one more drawn from ``rng``; the few
    other windows (the last of a rank, the leftover) are apportioned in turn, each in
    proportion to what is left. ``"random"``: the counts of a random arrangement of all the
    epoch's samples (hypergeometric splits, halving the windows).
    """
    if mode == "random":
        return _random(counts, lens, rng)
    total = int(counts.sum())
    k = len(counts)
    out = np.zeros((len(lens), k), np.int64)
    full = np.flatnonzero(lens == batch_size)
    odd = np.flatnonzero(lens != batch_size)
    m = len(full)
    floor = batch_size * counts // total
    extra = batch_size - int(floor.sum())  # streams with one more, in every full window
    # The windows with one more of stream s: m * frac(batch_size * count / T) of them, rounded
    # by largest remainder (so they sum to m * extra); each at most m, and the odd windows are
    # left at least 0 of every stream (ceil(x) < x + 1).
    num = m * (batch_size * counts - floor * total)
    more = num // total
    short = m * extra - int(more.sum())
    if short:
        more[np.argsort(-(num % total), kind="stable")[:short]] += 1
    out[full] = floor
    if extra and m:
        # Strided: window j takes the picks j, j + m, ...: each stream's run of at most m picks
        # gives a window one at most. The windows are then spread by a permutation.
        picks = np.repeat(np.arange(k), more)
        spread = rng.permutation(m)
        np.add.at(out, (full[spread[np.arange(m * extra) % m]], picks), 1)
    out[odd] = _in_turn(counts - m * floor - more, lens[odd])
    return out


def _in_turn(totals: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``totals`` apportioned to windows of ``lens`` rows, one after the other, each in
    proportion to what is left (largest remainder): exact, and never below 0."""
    out = np.zeros((len(lens), len(totals)), np.int64)
    rest = totals.astype(np.int64).copy()
    left = int(rest.sum())
    for i, length in enumerate(lens.tolist()):
        num = rest * length
        share = num // left
        short = length - int(share.sum())
        if short:
            share[np.argsort(-(num % left), kind="stable")[:short]] += 1
        out[i] = share
        rest -= share
        left -= length
    return out


def _random(counts: np.ndarray, lens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    k = len(counts)
    ends = np.concatenate(([0], np.cumsum(lens)))
    out = np.zeros((len(lens), k), np.int64)
    lo, hi = np.array([0]), np.array([len(lens)])
    have = counts[None, :].astype(np.int64)
    while len(lo):
        leaf = hi - lo == 1
        out[lo[leaf]] = have[leaf]
        lo, hi, have = lo[~leaf], hi[~leaf], have[~leaf]
        mid = (lo + hi) // 2
        need = ends[mid] - ends[lo]
        rest = ends[hi] - ends[lo]
        left = np.zeros_like(have)
        for s in range(k):  # the left half's count of each stream, drawn without replacement
            good = have[:, s]
            got = rng.hypergeometric(good, rest - good, need)
            left[:, s] = got
            rest = rest - good
            need = need - got
        lo, hi = np.concatenate((lo, mid)), np.concatenate((mid, hi))
        have = np.concatenate((left, have - left))
    return out


def per_stream(
    counts: Sequence[int],
    names: Sequence[str],
    batch_size: int,
    world_size: int,
    drop_last: bool,
    stream: bool,
    rng: np.random.Generator | None,
) -> tuple[np.ndarray, tuple[int, ...], np.ndarray]:
    """``"per_stream"`` windows: each stream's samples cut into every rank's batches by the
    rules of one source (:func:`~._plan.batch_layout`: equal batch counts per rank, for every
    stream), a rank's full batches interleaved (each stream's ``j``-th at ``(j + 1/2) / its
    full batches``, or in a random order with ``rng``), its shorter ones last; then, with
    ``drop_last``, each stream's leftover as a window of no rank. Windows, ranks' first
    windows, and counts (one stream per window)."""
    who: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    firsts = [0]
    for rank in range(world_size):
        full: list[np.ndarray] = []
        tails: list[tuple[int, int]] = []
        for s, c in enumerate(counts):
            if c == 0:
                continue
            try:
                f, tail = _layout(c, batch_size, rank, world_size, drop_last, stream)
            except ConfigurationError as exc:
                raise ConfigurationError(f"stream {names[s]!r}: {exc}") from None
            full.append(np.full(f, s, np.int64))
            tails += [(s, n) for n in tail]
        ids = np.concatenate(full)
        if rng is not None:
            ids = ids[rng.permutation(len(ids))]
        else:
            per = np.bincount(ids, minlength=len(counts))
            j = np.arange(len(ids)) - np.repeat(np.cumsum(per) - per, per)
            key = (2 * j + 1) * 2**31 // (2 * per[ids])
            ids = ids[np.argsort(key, kind="stable")]
        who += [ids, np.array([s for s, _ in tails], np.int64)]
        lens += [np.full(len(ids), batch_size, np.int64), np.array([n for _, n in tails], np.int64)]
        firsts.append(firsts[-1] + len(ids) + len(tails))
    ids, sizes = np.concatenate(who), np.concatenate(lens)
    left = np.array(counts, np.int64) - np.bincount(ids, sizes, len(counts)).astype(np.int64)
    extra = np.flatnonzero(left > 0)  # drop_last: each stream's leftover, of no rank
    ids, sizes = np.concatenate((ids, extra)), np.concatenate((sizes, left[extra]))
    table = np.zeros((len(ids), len(counts)), np.int64)
    table[np.arange(len(ids)), ids] = sizes
    return sizes, tuple(firsts), table


@functools.lru_cache(maxsize=4)
def epoch_table(
    counts: tuple[int, ...],
    names: tuple[str, ...],
    batch_size: int,
    world_size: int,
    drop_last: bool,
    stream: bool,
    mode: str,
    shuffle: bool,
    seed: int,
    epoch: int,
) -> tuple[np.ndarray, tuple[int, ...], np.ndarray]:
    """An epoch's windows (lengths), each rank's first window (and the end), and each window's
    count of every stream. Cached: every rank of an elastic resume's old run plans the same
    epoch. Unshuffled, the windows are arranged the same way every epoch."""
    rng = np.random.default_rng(seed_tuple(seed if shuffle else 0, epoch if shuffle else 0, SALT))
    if mode == "per_stream":
        lens, firsts, table = per_stream(
            counts, names, batch_size, world_size, drop_last, stream, rng if shuffle else None
        )
    else:
        lens, firsts = windows(sum(counts), batch_size, world_size, drop_last, stream)
        table = allocate(np.array(counts, np.int64), lens, batch_size, mode, rng)
    lens.flags.writeable = table.flags.writeable = False  # cached: shared by every caller
    return lens, firsts, table
