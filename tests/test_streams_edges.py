"""Streams at their edges, through the whole layer (issue 33 review): a downsampled stream's
walk survives an exact resume mid-epoch and goes on across the next epochs, on one rank and on
two; an elastic resume keeps every epoch's rows; ``len()`` is the batches yielded on every rank;
a stream of one 10-row file beside 100k rows under a small cache never waits on itself.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, CacheBudgetWarning, HDF5DataLayer, Stream

from ._files import ROW_BYTES, check_batch, write_h5
from .test_streams import write_streams

DEADLINE = 60


def layer_of(source: Any, rank: int, world: int, **kw: Any) -> HDF5DataLayer:
    args: dict[str, Any] = {"batch_size": 8, "shuffle": True, "seed": 11, "chunk_size": 32}
    args.update(kw)
    return HDF5DataLayer(source, rank=rank, world_size=world, **args)


def run_epochs(layer: HDF5DataLayer, n: int) -> list[list[np.ndarray]]:
    out = []
    with layer:
        for _ in range(n):
            expected = len(layer)
            got = [b.indices.copy() for b in layer]
            assert len(got) == expected, "len() is not the batches yielded"
            out.append(got)
    return out


@pytest.mark.timeout(DEADLINE)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["stratified", "per_stream"])
def test_an_exact_resume_mid_epoch_continues_a_downsampled_walk(
    tmp_path: Path, world: int, mode: str
) -> None:
    """ "big" (200 samples) gives 60 an epoch: five epochs walk it once and a half. A state taken
    mid-epoch 2 on every rank resumes batch for batch, and epochs 3 and 4 after it are those
    of the uninterrupted run: the walk's first 200 draws are a permutation."""
    files = write_streams(tmp_path, ((200,), (24,)))
    source = {"big": Stream(files[0], choose=60), "small": Stream(files[1])}
    kw = {"batch_mode": mode}
    whole = [run_epochs(layer_of(source, r, world, **kw), 5) for r in range(world)]
    for rank in range(world):
        layer = layer_of(source, rank, world, **kw)
        with layer:
            for _ in range(2):
                for _ in layer:
                    pass
            for k, _ in enumerate(layer):
                if k == 2:
                    state = layer.state_dict()
                    break
        again = layer_of(source, rank, world, **kw)
        again.load_state_dict(state)
        with again:
            assert len(again) == len(whole[rank][2]) - 3
            rest = [[b.indices.copy() for b in again]]
            rest += [[b.indices.copy() for b in again] for _ in range(2)]
        want = [whole[rank][2][3:], whole[rank][3], whole[rank][4]]
        for got_epoch, want_epoch in zip(rest, want, strict=True):
            assert len(got_epoch) == len(want_epoch)
            for x, y in zip(got_epoch, want_epoch, strict=True):
                np.testing.assert_array_equal(x, y)
    # The walk of "big", epoch after epoch, rank after rank: 300 draws, the first 200 distinct.
    big = np.concatenate([b[b < 200] for e in range(5) for r in range(world) for b in whole[r][e]])
    assert len(big) == 300
    np.testing.assert_array_equal(np.sort(big[:200]), np.arange(200))
    assert len(np.unique(big[200:])) == 100


@pytest.mark.timeout(DEADLINE)
def test_an_elastic_resume_keeps_each_epochs_rows_and_the_walk_goes_on(tmp_path: Path) -> None:
    """Two ranks stop mid-epoch 1; three ranks finish it and run epoch 2: epoch 1's rows are
    the uninterrupted run's, each as often, and epoch 2 is the uninterrupted run's epoch 2."""
    files = write_streams(tmp_path, ((200,), (24,)))
    source = {"big": Stream(files[0], choose=60), "small": Stream(files[1], choose=60)}
    whole = [run_epochs(layer_of(source, r, 2), 3) for r in range(2)]
    states, before = [], []
    for rank in range(2):
        layer = layer_of(source, rank, 2)
        with layer:
            for _ in layer:
                pass
            got = []
            for b in layer:
                got.append(b.indices.copy())
                if len(got) == 3:
                    states.append(layer.state_dict())
                    break
        before += got
    after: list[np.ndarray] = []
    epoch2: list[np.ndarray] = []
    lens = []
    for rank in range(3):
        layer = layer_of(source, rank, 3)
        layer.load_state_dict(states[rank % 2])
        with layer:
            n = len(layer)
            rest = [b.indices.copy() for b in layer]
            assert len(rest) == n
            lens.append(n)
            epoch2 += [b.indices.copy() for b in layer]
        after += rest
    assert len(set(lens)) == 1
    want1 = np.sort(np.concatenate([b for r in range(2) for b in whole[r][1]]))
    np.testing.assert_array_equal(np.sort(np.concatenate(before + after)), want1)
    # Epoch 2 on three ranks draws the same rows as on two (the walks do not depend on ranks).
    want2 = np.sort(np.concatenate([b for r in range(2) for b in whole[r][2]]))
    np.testing.assert_array_equal(np.sort(np.concatenate(epoch2)), want2)


@pytest.mark.timeout(DEADLINE)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
def test_len_is_the_batches_yielded_on_every_rank(
    tmp_path: Path, drop_last: bool, mode: str
) -> None:
    files = write_streams(tmp_path, ((90, 41), (17,), (5,)))
    source = {
        "a": Stream(files[0], weight=0.6),
        "b": Stream(files[1], weight=0.4),
        "c": Stream(files[2], choose=33),
    }
    for world in (1, 3):
        counts = []
        for rank in range(world):
            layer = layer_of(source, rank, world, batch_mode=mode, drop_last=drop_last)
            epochs = run_epochs(layer, 2)
            for batches in epochs:
                counts.append(len(batches))
                if drop_last:
                    assert all(len(b) == 8 for b in batches)
        assert len(set(counts)) == 1, counts


@pytest.mark.both_backends
@pytest.mark.anyio
@pytest.mark.timeout(0)  # the deadline below
@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
@pytest.mark.parametrize("drop_last", [False, True])
async def test_a_10_row_stream_beside_100k_rows_under_a_small_cache(
    tmp_path: Path, mode: Literal["stratified", "random", "per_stream"], drop_last: bool
) -> None:
    """One file of 10 rows upsampled beside 100,000 rows downsampled, a cache of a few hundred
    rows: every epoch ends under its deadline, with each stream's count."""
    folder = tmp_path / "huge"
    folder.mkdir()
    huge = [write_h5(folder / "h.h5", 0, 100_000)]
    tiny = [write_h5(folder / "t.h5", 100_000, 10)]
    source = {"huge": Stream(huge, choose=3000), "tiny": Stream(tiny, choose=500)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)
        layer = AsyncHDF5DataLayer(
            source,
            batch_size=50,
            shuffle=True,
            seed=3,
            chunk_size=200,
            cache_bytes=3 * 200 * ROW_BYTES,
            batch_mode=mode,
            drop_last=drop_last,
        )
        with anyio.fail_after(DEADLINE):
            async with layer:
                for _ in range(2):
                    idx = []
                    async for b in layer:
                        check_batch(b, b.size)
                        idx.append(b.indices.copy())
                    got = np.concatenate(idx)
                    assert (got >= 100_000).sum() == 500
                    assert (got < 100_000).sum() == 3000
                    assert len(np.unique(got[got < 100_000])) == 3000


@pytest.mark.anyio
@pytest.mark.timeout(0)  # the deadline below
@pytest.mark.parametrize("mode", ["stratified", "random", "per_stream"])
async def test_stream_iteration_over_streams_resumes_exactly(
    tmp_path: Path, mode: Literal["stratified", "random", "per_stream"]
) -> None:
    """``layer.stream()`` with streams: a state taken after batch 9 (in the second epoch: 47
    samples an epoch, batches of 10 straddle them) continues with batch 10, and on."""
    files = write_streams(tmp_path, ((50,), (13,)))
    source = {"a": Stream(files[0], choose=30), "b": Stream(files[1], choose=17)}

    def make() -> AsyncHDF5DataLayer:
        return AsyncHDF5DataLayer(
            source, batch_size=10, shuffle=True, seed=7, chunk_size=20, batch_mode=mode
        )

    async def take(layer: AsyncHDF5DataLayer, n: int, at: int | None = None) -> Any:
        got, state = [], None
        async with layer:
            async for b in layer.stream():
                check_batch(b, 10)
                got.append(b.indices.copy())
                if len(got) == at:
                    state = layer.state_dict()
                if len(got) == n:
                    break
        return got, state

    with anyio.fail_after(DEADLINE):
        whole, _ = await take(make(), 20)
        _, state = await take(make(), 10, at=10)
        again = make()
        again.load_state_dict(state)
        rest, _ = await take(again, 10)
    for x, y in zip(rest, whole[10:], strict=True):
        np.testing.assert_array_equal(x, y)
