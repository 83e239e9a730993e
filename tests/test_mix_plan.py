"""The mixed planner's promises at their edges (issue 33, docs/mixing.md), pure: no file.

:func:`~asynchdf5._mix.plan_mixed` over streams of global rows, every rank of every epoch, the
batches cut from the chunks' serving order as the layer cuts them. Checked: stratified
per-batch counts rounded down or up and exact epoch totals; random totals; per-stream batches;
a downsampled stream's walk across epochs and ranks (every sample before any repeat), an
upsampled one's (whole permutations, then a part), the natural share (exactly once); weight 0,
a stream larger than the others' total, one stream alone; ``drop_last``; equal batch counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from asynchdf5._mix import StreamRows, plan_mixed
from asynchdf5._streams import StreamSpec, stream_counts

from ._files import check_exactly_once


def rows(sizes: Sequence[int], counts: Sequence[int]) -> list[StreamRows]:
    starts = np.cumsum([0, *sizes])
    return [
        StreamRows(f"s{k}", int(starts[k]), n, c)
        for k, (n, c) in enumerate(zip(sizes, counts, strict=True))
    ]


def batches(
    streams: Sequence[StreamRows], epoch: int, rank: int, world: int, **kw: object
) -> list[np.ndarray]:
    """Rank ``rank``'s batches of ``epoch``: its chunks' served rows cut into its batch sizes."""
    args: dict[str, object] = {"batch_size": 8, "chunk_size": 24, "shuffle": True, "seed": 5}
    args.update(kw)
    plan = plan_mixed(streams, epoch=epoch, rank=rank, world_size=world, **args)  # type: ignore[arg-type]
    for c in plan.chunks:
        assert c.rows <= int(args["chunk_size"])  # type: ignore[call-overload]
    idx = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
    sizes = list(plan.batch_sizes())
    assert len(idx) >= sum(sizes)
    cuts = np.cumsum([0, *sizes])
    return [idx[a:b] for a, b in itertools.pairwise(cuts)]


def epoch_rows(
    streams: Sequence[StreamRows], epoch: int, world: int, **kw: object
) -> list[list[np.ndarray]]:
    out = [batches(streams, epoch, r, world, **kw) for r in range(world)]
    assert len({len(b) for b in out}) == 1, "unequal batch counts over the ranks"
    return out


def labels(idx: np.ndarray, streams: Sequence[StreamRows]) -> np.ndarray:
    return np.searchsorted([s.start for s in streams[1:]], idx, side="right")


CASES = [
    ((100, 37, 9), (60, 61, 30)),  # down, up, up
    ((1000, 10), (300, 300)),
    ((50, 50), (50, 50)),  # natural
    ((13, 200, 7), (13, 5, 41)),
]


@pytest.mark.parametrize(("sizes", "counts"), CASES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_stratified_batches_round_each_share_and_the_epoch_is_exact(
    sizes: tuple[int, ...], counts: tuple[int, ...], world: int, shuffle: bool
) -> None:
    streams = rows(sizes, counts)
    total = sum(counts)
    for epoch in (0, 3):
        per_rank = epoch_rows(streams, epoch, world, shuffle=shuffle)
        got = np.zeros(len(sizes), np.int64)
        for bs in per_rank:
            for b in bs:
                n = np.bincount(labels(b, streams), minlength=len(sizes))
                if len(b) == 8:
                    share = 8 * np.array(counts) / total
                    assert np.all((np.floor(share) <= n) & (n <= np.ceil(share))), (n, share)
                got += n
        np.testing.assert_array_equal(got, counts)


@pytest.mark.parametrize("mode", ["random", "per_stream"])
@pytest.mark.parametrize("world", [1, 2])
def test_random_and_per_stream_epochs_are_exact(mode: str, world: int) -> None:
    streams = rows((100, 37, 9), (60, 61, 30))
    for epoch in (0, 1, 4):
        per_rank = epoch_rows(streams, epoch, world, mode=mode)
        every = [b for bs in per_rank for b in bs]
        got = np.bincount(labels(np.concatenate(every), streams), minlength=3)
        np.testing.assert_array_equal(got, [60, 61, 30])
        if mode == "per_stream":
            for b in every:
                assert len(set(labels(b, streams).tolist())) == 1


def walk(
    streams: Sequence[StreamRows], s: int, epochs: int, world: int, **kw: object
) -> np.ndarray:
    """Stream ``s``'s rows, epoch after epoch, rank after rank, in serving order."""
    out = []
    for e in range(epochs):
        for bs in epoch_rows(streams, e, world, **kw):
            for b in bs:
                out.append(b[labels(b, streams) == s] - streams[s].start)
    return np.concatenate(out)


def check_passes(seq: np.ndarray, size: int) -> None:
    """Every ``size`` consecutive rows from the start are a permutation (the last may be a
    part of one, without a repeat)."""
    for k in range(0, len(seq), size):
        part = seq[k : k + size]
        assert len(np.unique(part)) == len(part), f"a repeat within pass {k // size}"
        if len(part) == size:
            check_exactly_once([part], size)


#: The first chunk ramped from lanes, and every chunk dealt from lanes (a small cache).
LANES = {"first_rows": 3, "ramp_lanes": 4, "chunk_lanes": 8}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
@pytest.mark.parametrize("lanes", [False, True])
def test_a_downsampled_stream_sees_every_sample_before_a_repeat_across_epochs(
    world: int, mode: str, lanes: bool
) -> None:
    """1,000 samples choosing 300 an epoch over 7 epochs: the first 1,000 drawn are a
    permutation, then the next 1,000 (on every rank, in rank order)."""
    streams = rows((1000, 64), (300, 64))
    kw: dict[str, object] = {"mode": mode, "batch_size": 16, "chunk_size": 64, "block_size": 8}
    seq = walk(streams, 0, 7, world, **kw, **(LANES if lanes else {}))
    assert len(seq) == 2100
    check_passes(seq, 1000)
    # Each epoch continues where the last one stopped: pass 1 is a new permutation.
    assert not np.array_equal(seq[:100], seq[1000:1100])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("lanes", [False, True])
def test_an_upsampled_stream_repeats_whole_permutations_then_a_part(
    world: int, lanes: bool
) -> None:
    streams = rows((7, 100), (50, 100))  # 7 samples, 50 a epoch: 7 whole passes and 1 row
    seq = walk(streams, 0, 3, world, batch_size=10, chunk_size=30, **(LANES if lanes else {}))
    assert len(seq) == 150
    check_passes(seq, 7)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_natural_shares_give_every_sample_exactly_once(world: int) -> None:
    streams = rows((100, 37, 9), (100, 37, 9))
    for epoch in range(3):
        every = [b for bs in epoch_rows(streams, epoch, world, batch_size=5) for b in bs]
        check_exactly_once(every, 146)


def test_a_single_stream_mapping_is_one_sources_epoch() -> None:
    streams = rows((77,), (77,))
    for world in (1, 2):
        for epoch in range(2):
            check_exactly_once([b for bs in epoch_rows(streams, epoch, world) for b in bs], 77)


def test_a_stream_of_weight_0_gives_nothing_and_the_others_their_epoch() -> None:
    specs = [StreamSpec("a", (), None, None), StreamSpec("b", (), 0.0, None)]
    counts = stream_counts(specs, [40, 30])
    assert counts == (40, 0)
    streams = rows((40, 30), counts)
    for world in (1, 2):
        every = [b for bs in epoch_rows(streams, 1, world, batch_size=6) for b in bs]
        check_exactly_once(every, 40)


def test_choose_larger_than_the_others_total() -> None:
    """A stream choosing 500 beside 30 samples at their natural share: 500 of 35 samples (14
    whole passes and a part), and stratified batches of 16 hold 15 or 16 of it."""
    streams = rows((35, 30), (500, 30))
    for world in (1, 2):
        per_rank = epoch_rows(streams, 0, world, batch_size=16)
        every = [b for bs in per_rank for b in bs]
        got = np.bincount(labels(np.concatenate(every), streams), minlength=2)
        np.testing.assert_array_equal(got, [500, 30])
        for b in every:
            if len(b) == 16:
                assert (labels(b, streams) == 0).sum() in (15, 16)
    check_passes(walk(streams, 0, 2, 1, batch_size=16), 35)


@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_drop_last_batches_are_full_and_equal_on_every_rank(mode: str, world: int) -> None:
    streams = rows((100, 37, 9), (60, 61, 30))
    per_rank = epoch_rows(streams, 2, world, mode=mode, drop_last=True)
    for bs in per_rank:
        assert bs and all(len(b) == 8 for b in bs)
    every = np.concatenate([b for bs in per_rank for b in bs])
    assert len(np.unique(every)) <= len(every)
    got = np.bincount(labels(every, streams), minlength=3)
    assert np.all(got <= [60, 61, 30])
    if mode != "per_stream":
        assert len(every) == (151 // (8 * world)) * 8 * world


@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
def test_drop_last_skips_a_downsampled_streams_leftover_but_never_repeats_early(
    mode: str,
) -> None:
    """docs/mixing.md, Limits: with ``drop_last`` the walk still advances by the whole count,
    so the leftover's samples are skipped in that pass; what is served within a pass is still
    distinct."""
    streams = rows((1000, 64), (300, 64))  # 364 an epoch, batches of 16: 12 left out
    seq = walk(streams, 0, 3, 1, mode=mode, batch_size=16, drop_last=True)
    assert len(seq) < 900
    assert len(np.unique(seq)) == len(seq)
