"""The planner is pure: shuffling and sharding are checked here without any file."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asynchdf5 import ConfigurationError
from asynchdf5._config import RAMP_LANES
from asynchdf5._plan import ChunkPlan, EpochPlan, plan_epoch, shard_share
from asynchdf5._sizing import RAMP_BYTES, first_read
from asynchdf5._walk import Lanes, Walk, append_range

from ._files import split_refused
from ._helpers import examples


def _by_search(chunk: ChunkPlan, positions: np.ndarray) -> np.ndarray:
    """Global indices of slot ``positions``, found by a binary search over the chunk's ranges:
    an oracle independent of the pipeline's map of slot rows."""
    starts = np.array([a for a, _ in chunk.ranges], np.int64)
    lengths = np.array([b - a for a, b in chunk.ranges], np.int64)
    firsts = np.cumsum(lengths) - lengths
    which = np.searchsorted(firsts, positions, side="right") - 1
    out: np.ndarray = positions + starts[which] - firsts[which]
    return out


def served(plan: EpochPlan) -> np.ndarray:
    """Global indices of the plan's share, in serving order."""
    parts = [np.empty(0, np.int64)]
    for c in plan.chunks:
        order = c.order()
        pos = np.arange(c.size) if order is None else order
        parts.append(_by_search(c, pos))
        # The pipeline's way (a map of slot rows, built once per loaded chunk) agrees.
        np.testing.assert_array_equal(c.served_indices(order), parts[-1])
    return np.concatenate(parts)


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 3000),
    batch_size=st.integers(1, 300),
    chunk_mult=st.integers(1, 10),
    world_size=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
    ramp=st.one_of(st.none(), st.integers(1, 500)),
    lanes=st.integers(1, 40),
    block=st.one_of(st.none(), st.integers(1, 300)),
    chunk_lanes=st.integers(1, 50),
)
def test_shards_are_disjoint_cover_everything_and_have_equal_batch_counts(
    n: int,
    batch_size: int,
    chunk_mult: int,
    world_size: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    epoch: int,
    ramp: int | None,
    lanes: int,
    block: int | None,
    chunk_lanes: int,
) -> None:
    kw = dict(
        epoch=epoch,
        batch_size=batch_size,
        chunk_size=batch_size * chunk_mult,
        shuffle=shuffle,
        seed=seed,
        world_size=world_size,
        drop_last=drop_last,
        first_rows=ramp,
        ramp_lanes=lanes,
        block_size=block,
        chunk_lanes=chunk_lanes,
    )
    try:
        plans = [plan_epoch(n, rank=r, **kw) for r in range(world_size)]  # type: ignore[arg-type]
    except ConfigurationError as exc:
        # Only the documented impossible cases may refuse.
        assert split_refused(n, batch_size, world_size, drop_last), exc
        return
    everything = np.sort(np.concatenate([served(p) for p in plans]))
    if drop_last:  # the leftover of fewer than world_size * batch_size samples is left out
        assert len(np.unique(everything)) == len(everything)
        assert np.isin(everything, np.arange(n)).all()
        assert n - len(everything) < world_size * batch_size
    else:
        assert np.array_equal(everything, np.arange(n))
    assert len({p.n_batches for p in plans}) == 1
    for p in plans:
        sizes = list(p.batch_sizes())
        assert all(0 < s <= batch_size for s in sizes)
        assert sum(sizes) == p.n_served <= p.n_samples
        if drop_last:
            assert all(s == batch_size for s in sizes)
        assert p.n_served == p.n_samples
        assert all(c.size <= kw["chunk_size"] for c in p.chunks)  # type: ignore[operator]
        assert all(c.size > 0 for c in p.chunks)
        if not shuffle and world_size == 1 and not drop_last:
            assert np.array_equal(served(p), np.arange(n))


def test_same_seed_same_order_epochs_differ() -> None:
    kw = dict(batch_size=10, chunk_size=100, shuffle=True)
    a = served(plan_epoch(1000, epoch=0, seed=7, **kw))  # type: ignore[arg-type]
    b = served(plan_epoch(1000, epoch=0, seed=7, **kw))  # type: ignore[arg-type]
    c = served(plan_epoch(1000, epoch=1, seed=7, **kw))  # type: ignore[arg-type]
    d = served(plan_epoch(1000, epoch=0, seed=8, **kw))  # type: ignore[arg-type]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, d)


def test_shuffle_rotates_chunk_boundaries_and_permutes_chunks() -> None:
    starts = set()
    orders = set()
    for epoch in range(20):
        p = plan_epoch(1000, epoch=epoch, batch_size=10, chunk_size=100, shuffle=True, seed=1)
        starts.add(p.chunks[0].ranges[0][0] % 100)
        orders.add(tuple(c.ranges[0][0] for c in p.chunks))
        for c in p.chunks:  # a chunk is contiguous on the ring: at most two ranges
            assert 1 <= len(c.ranges) <= 2
    assert len(starts) > 1
    assert len(orders) == 20


def test_ramp_splits_only_the_first_chunk_into_growing_pieces() -> None:
    p = plan_epoch(
        10_000, epoch=0, batch_size=10, chunk_size=4000, shuffle=False, seed=0, first_rows=100
    )
    sizes = [c.size for c in p.chunks]
    assert sizes[:5] == [100, 200, 400, 800, 2500]
    assert sizes[5:] == [4000, 2000]


def test_shuffled_ramp_pieces_are_taken_from_every_lane() -> None:
    """Each piece of the ramp takes its share of each of the 16 lanes of the first chunk: even
    the first piece (1,000 rows, with blocks of 100) is read from 16 places, not one or two."""
    kw = dict(epoch=0, batch_size=10, chunk_size=2**15, shuffle=True, seed=0, first_rows=1000)
    kw |= dict(block_size=100)
    lanes = plan_epoch(100_000, ramp_lanes=16, **kw)  # type: ignore[arg-type]
    one = plan_epoch(100_000, ramp_lanes=1, **kw)  # type: ignore[arg-type]
    assert len(lanes.chunks) == len(one.chunks)
    k = 5  # 1,000 + 2,000 + 4,000 + 8,000, then the rest of the first chunk's 32,768
    assert [c.rows for c in one.chunks[:k]] == [1000, 2000, 4000, 8000, 17768]
    for mine, theirs in zip(lanes.chunks[:k], one.chunks[:k], strict=True):
        assert abs(mine.rows - theirs.rows) < 16  # each lane's share rounded down
    assert len(lanes.chunks[0].ranges) >= 16
    assert len(one.chunks[0].ranges) <= 11  # 1,000 rows of blocks of 100
    # The same samples in the first chunk's pieces, the rest of the epoch unchanged.
    first = [served(dataclasses.replace(p, chunks=p.chunks[:k])) for p in (lanes, one)]
    assert np.array_equal(np.sort(first[0]), np.sort(first[1]))
    assert [c.ranges for c in lanes.chunks[k:]] == [c.ranges for c in one.chunks[k:]]


@pytest.mark.parametrize("batch_size", [64, 256])
def test_the_first_piece_of_the_ramp_holds_a_whole_batch_with_large_rows(batch_size: int) -> None:
    """With rows of 150 kB a batch is more than the ramp's first 8 MiB; each lane's share is
    rounded down, so a first read of exactly a batch came up short of one (in 1,108 of 1,144
    chunk sizes): the first batch then waited for the second piece as well."""
    row_bytes = 150_000
    first, lanes = first_read(batch_size, row_bytes, shuffle=True)
    assert lanes == RAMP_LANES
    for rows in range(1000, 5000, 7):
        first_chunks = _ramped_first_chunks(10 * rows, batch_size, rows, first, lanes)
        assert first_chunks[0] >= batch_size, (rows, first_chunks)


def _ramped_first_chunks(n: int, batch_size: int, rows: int, first: int, lanes: int) -> list[int]:
    """Rows of the first three chunks of a shuffled epoch over ``n`` samples, ramped."""
    plan = plan_epoch(
        n,
        epoch=0,
        batch_size=batch_size,
        chunk_size=rows,
        shuffle=True,
        seed=rows,
        first_rows=first,
        ramp_lanes=lanes,
    )
    return [c.rows for c in plan.chunks[:3]]


@pytest.mark.parametrize("row_mib", [1, 4, 32])
@pytest.mark.parametrize("batch_size", [1, 2, 4, 8])
def test_small_batches_of_large_rows_wait_for_a_small_first_read(
    row_mib: int, batch_size: int
) -> None:
    """The first read is padded by what the lanes' rounding can lose, not by ``RAMP_LANES - 1``
    rows whatever the lanes: that made the first batch of 1 to 8 rows of 4 MiB wait for 28 to
    38 rows (review 14, D2). It still holds a whole batch, for every chunk size."""
    row_bytes = row_mib * 2**20
    first, lanes = first_read(batch_size, row_bytes, shuffle=True)
    assert first <= max(2 * batch_size - 1, RAMP_BYTES // row_bytes), (first, lanes)
    for rows in range(2 * batch_size, 300, 3):
        first_chunks = _ramped_first_chunks(7 * rows, batch_size, rows, first, lanes)
        assert first_chunks[0] >= batch_size, (rows, first_chunks)


def test_uneven_leftover_splits_a_batch_instead_of_repeating_or_dropping() -> None:
    # 2 ranks, batch 4: 9 samples -> q = 1 round of 8, leftover 1 < world_size.
    plans = [
        plan_epoch(
            9, epoch=0, batch_size=4, chunk_size=4, shuffle=False, seed=0, rank=r, world_size=2
        )
        for r in range(2)
    ]
    assert [list(p.batch_sizes()) for p in plans] == [[4, 1], [3, 1]]


def test_impossible_split_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="drop_last=True"):
        plan_epoch(
            3, epoch=0, batch_size=1, chunk_size=1, shuffle=False, seed=0, rank=1, world_size=2
        )
    with pytest.raises(ConfigurationError, match="fewer than world_size"):
        plan_epoch(
            2, epoch=0, batch_size=1, chunk_size=1, shuffle=False, seed=0, rank=0, world_size=3
        )


@settings(max_examples=examples(100), deadline=None)
@example(n=3, batch_size=1, world_size=2, drop_last=False, stream=False)  # rank 1 alone refused
@given(
    n=st.integers(1, 200),
    batch_size=st.integers(1, 40),
    world_size=st.integers(1, 8),
    drop_last=st.booleans(),
    stream=st.booleans(),
)
def test_every_rank_gets_the_same_answer(
    n: int, batch_size: int, world_size: int, drop_last: bool, stream: bool
) -> None:
    """A configuration is refused on every rank or on none (a rank refusing alone would leave
    the others waiting in their collectives forever)."""
    outcomes = []
    for rank in range(world_size):
        try:
            plan_epoch(
                n,
                epoch=0,
                batch_size=batch_size,
                chunk_size=batch_size,
                shuffle=False,
                seed=0,
                rank=rank,
                world_size=world_size,
                drop_last=drop_last,
                stream=stream,
            )
            outcomes.append("ok")
        except ConfigurationError as exc:
            outcomes.append(str(exc))
    assert len(set(outcomes)) == 1, outcomes


@given(
    n=st.integers(1, 500),
    batch_size=st.integers(1, 40),
    world_size=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_stream_plans_ignore_drop_last(
    n: int, batch_size: int, world_size: int, drop_last: bool
) -> None:
    """stream() batches are always full and wrap across epochs: no sample is ever left out."""
    if n < world_size:
        return
    plans = [
        plan_epoch(
            n,
            epoch=1,
            batch_size=batch_size,
            chunk_size=7,
            shuffle=True,
            seed=3,
            rank=r,
            world_size=world_size,
            drop_last=drop_last,
            stream=True,
        )
        for r in range(world_size)
    ]
    everything = np.sort(np.concatenate([served(p) for p in plans]))
    np.testing.assert_array_equal(everything, np.arange(n))


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 5000),
    chunk_size=st.integers(1, 900),
    lanes=st.integers(2, 60),
    block=st.integers(1, 400),
    seed=st.integers(0, 2**32),
    world_size=st.integers(1, 4),
)
def test_laned_chunks_are_full_and_join_the_walks_ranges(
    n: int, chunk_size: int, lanes: int, block: int, seed: int, world_size: int
) -> None:
    """Laned chunks hold exactly ``chunk_size`` rows (one of a share, the rest), the share's
    samples once, and the global ranges the walk gives stretch by stretch, neighbours joined."""
    world_size = min(world_size, n)
    kw = dict(epoch=0, batch_size=1, shuffle=True, seed=seed, block_size=block, drop_last=True)
    for rank in range(world_size):
        args = dict(rank=rank, world_size=world_size, **kw)
        plan = plan_epoch(n, chunk_size=chunk_size, chunk_lanes=lanes, **args)  # type: ignore[arg-type]
        plain = plan_epoch(n, chunk_size=chunk_size, **args)  # type: ignore[arg-type]
        assert all(c.rows <= chunk_size for c in plan.chunks)
        assert sum(c.rows != chunk_size for c in plan.chunks) <= 1
        assert np.array_equal(np.sort(served(plan)), np.sort(served(plain)))
        walk = Walk(n, 0, seed, True, block)
        start, size = shard_share(n, 1, rank, world_size, True)
        laned = Lanes(walk, start, size, chunk_size, min(lanes, chunk_size, size))
        for k in range(laned.count):
            want: list[tuple[int, int]] = []
            for a, b in laned.stretches(k):
                for g0, g1 in walk.ranges(start + a, start + b):
                    append_range(want, g0, g1)
            assert laned.ranges(k) == tuple(want)
