"""The contract every layer passes: AsyncHDF5DataLayer, HDF5DataLayer and MemoryDataLayer.

Each layer class gets a driver with the same small interface; the tests below run against every
driver (zarr's ``StoreTests`` pattern). The data encode their global index (``label == index``,
``data == 10 * index``), so exactly-once and alignment are checked from the batches alone.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynchdf5 import AsyncHDF5DataLayer, Batch, HDF5DataLayer, MemoryDataLayer
from asynchdf5 import transforms as T

from ._files import IMAGE, check_exactly_once, rows, split_refused, write_source

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]  # the event loop matters


class Driver:
    """Opens a layer over files of the given sizes and runs epochs, collecting the batches."""

    kind = ""

    def __init__(self, folder: Path, sizes: Sequence[int], **kw: Any) -> None:
        self.folder, self.sizes, self.kw = folder, list(sizes), kw

    async def __aenter__(self) -> Driver:
        raise NotImplementedError

    async def __aexit__(self, *exc: object) -> None:
        raise NotImplementedError

    async def epoch(self, limit: int | None = None) -> list[Batch]:
        raise NotImplementedError

    async def stream(self, count: int) -> list[Batch]:
        raise NotImplementedError

    @property
    def epochs_done(self) -> int:
        raise NotImplementedError


class AsyncDriver(Driver):
    kind = "async-hdf5"

    def make(self) -> Any:
        src, _ = write_source(self.folder, self.sizes, shape=IMAGE)
        return AsyncHDF5DataLayer(src, **self.kw)

    async def __aenter__(self) -> Driver:
        self.layer = self.make()
        await self.layer.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.layer.__aexit__(None, None, None)

    async def epoch(self, limit: int | None = None) -> list[Batch]:
        out = []
        async for batch in self.layer:
            out.append(batch)
            if limit is not None and len(out) >= limit:
                break
        return out

    async def stream(self, count: int) -> list[Batch]:
        out = []
        async for batch in self.layer.stream():
            out.append(batch)
            if len(out) >= count:
                break
        return out

    @property
    def epochs_done(self) -> int:
        return int(self.layer.epoch)


class MemoryDriver(AsyncDriver):
    kind = "memory"

    def make(self) -> Any:
        data = rows(0, sum(self.sizes), IMAGE)
        kw = {k: v for k, v in self.kw.items() if k != "chunk_size"}
        return MemoryDataLayer(data, tops=("data", "label"), **kw)


class SyncDriver(Driver):
    """The sync facade, driven from inside a running event loop (which it must tolerate)."""

    kind = "sync-hdf5"

    async def __aenter__(self) -> Driver:
        src, _ = write_source(self.folder, self.sizes, shape=IMAGE)
        self.layer = HDF5DataLayer(src, **self.kw)
        self.layer.__enter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.layer.__exit__(None, None, None)

    async def epoch(self, limit: int | None = None) -> list[Batch]:
        it = iter(self.layer)
        return list(it if limit is None else itertools.islice(it, limit))

    async def stream(self, count: int) -> list[Batch]:
        return list(itertools.islice(self.layer.stream(), count))

    @property
    def epochs_done(self) -> int:
        return self.layer.epoch


DRIVERS = [AsyncDriver, SyncDriver, MemoryDriver]


@pytest.fixture(params=DRIVERS, ids=[d.kind for d in DRIVERS])
def driver(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    cls = request.param

    def make(
        sizes: Sequence[int] = (400, 0, 350, 250), folder: Path | None = None, **kw: Any
    ) -> Driver:
        kw.setdefault("batch_size", 64)
        return cls(folder or tmp_path, sizes, **kw)  # type: ignore[no-any-return]

    return make


def check_aligned(batches: Sequence[Batch]) -> np.ndarray:
    """Every batch's rows belong to its indices, for every top; returns the epoch's indices."""
    for b in batches:
        assert b.indices.dtype == np.int64
        assert set(b) == {"data", "label"}
        np.testing.assert_array_equal(b["label"], b.indices)
        np.testing.assert_array_equal(b["data"][:, 0, 0], b.indices * 10)
        assert len(b["data"]) == len(b.indices)
    if not batches:
        return np.empty(0, np.int64)
    return np.concatenate([b.indices for b in batches])


async def test_unshuffled_epoch_is_source_order(driver: Any) -> None:
    async with driver(batch_size=64, chunk_size=128) as d:
        for epoch in range(2):
            batches = await d.epoch()
            np.testing.assert_array_equal(check_aligned(batches), np.arange(1000))
            assert [len(b.indices) for b in batches] == [64] * 15 + [40]
            assert {b.epoch for b in batches} == {epoch}
            assert d.epochs_done == epoch + 1


async def test_shuffled_epochs_are_permutations_that_differ(driver: Any) -> None:
    async with driver(shuffle=True, seed=3, chunk_size=200) as d:
        orders = []
        for _ in range(3):
            batches = await d.epoch()
            check_exactly_once([check_aligned(batches)], 1000)
            orders.append(check_aligned(batches))
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    assert not np.array_equal(orders[0], np.arange(1000))


async def test_same_seed_same_batches(driver: Any) -> None:
    runs = []
    for _ in range(2):
        async with driver(shuffle=True, seed=11, chunk_size=300, batch_size=50) as d:
            runs.append([check_aligned(await d.epoch()) for _ in range(2)])
    for a, b in zip(runs[0], runs[1], strict=True):
        np.testing.assert_array_equal(a, b)


async def test_drop_last_leaves_out_only_the_last_partial_batch(driver: Any) -> None:
    async with driver(drop_last=True, batch_size=64, shuffle=True, seed=1) as d:
        for _ in range(2):
            batches = await d.epoch()
            idx = check_aligned(batches)
            assert len(batches) == 15 and all(len(b.indices) == 64 for b in batches)
            assert len(np.unique(idx)) == len(idx) == 960


async def test_shards_are_disjoint_and_cover_every_sample(driver: Any) -> None:
    per_rank = []
    for rank in range(3):
        async with driver(shuffle=True, seed=5, rank=rank, world_size=3, batch_size=32) as d:
            per_rank.append(await d.epoch())
    assert len({len(b) for b in per_rank}) == 1  # the same batch count on every rank
    check_exactly_once([check_aligned([b for r in per_rank for b in r])], 1000)


async def test_stream_yields_full_batches_across_epochs(driver: Any) -> None:
    async with driver(batch_size=96, shuffle=True, seed=2, chunk_size=250) as d:
        batches = await d.stream(50)  # 4800 samples: 4.8 epochs
        assert all(len(b.indices) == 96 for b in batches)
        idx = check_aligned(batches)
        for e in range(4):
            np.testing.assert_array_equal(np.sort(idx[e * 1000 : (e + 1) * 1000]), np.arange(1000))
        assert [b.epoch for b in batches][::10] == [0, 0, 1, 2, 3]
        assert d.epochs_done == 4


async def test_stream_ignores_drop_last(driver: Any) -> None:
    """stream() batches are always full and wrap across epochs: drop_last leaves nothing out."""
    async with driver(batch_size=96, drop_last=True, shuffle=True, seed=4, chunk_size=300) as d:
        batches = await d.stream(42)  # 4032 samples: 4 epochs and a bit
        assert all(len(b.indices) == 96 for b in batches)
        idx = check_aligned(batches)
        for e in range(4):
            np.testing.assert_array_equal(np.sort(idx[e * 1000 : (e + 1) * 1000]), np.arange(1000))


async def test_break_then_next_epoch_is_whole(driver: Any) -> None:
    async with driver(shuffle=True, seed=9, chunk_size=100, batch_size=50) as d:
        part = await d.epoch(limit=3)
        assert len(part) == 3 and {b.epoch for b in part} == {0}
        batches = await d.epoch()
        assert {b.epoch for b in batches} == {1}
        check_exactly_once([check_aligned(batches)], 1000)
        assert d.epochs_done == 2
        await d.stream(5)
        batches = await d.epoch()
        assert {b.epoch for b in batches} == {3}
        check_exactly_once([check_aligned(batches)], 1000)


async def test_transformers_run_in_order(driver: Any) -> None:
    chain = [("data", T.Scale(0.5)), ("data", lambda x: x + 1), ("label", T.Cast(np.float64))]
    async with driver(transformers=chain) as d:
        batches = await d.epoch()
    for b in batches:
        np.testing.assert_allclose(b["data"][:, 0, 0], b.indices * 5 + 1)
        assert b["label"].dtype == np.float64


async def test_batch_is_a_read_only_mapping(driver: Any) -> None:
    async with driver() as d:
        b = (await d.epoch(limit=1))[0]
    assert list(b.keys()) == ["data", "label"] and len(b) == 2
    with pytest.raises(TypeError):
        b["data"] = None  # type: ignore[index,unused-ignore]
    assert "rows=64" in repr(b)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.integers(0, 120), min_size=1, max_size=4).filter(lambda s: sum(s) > 0),
    batch_size=st.integers(1, 40),
    chunk_mult=st.integers(1, 6),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    world_size=st.integers(1, 3),
    drop_last=st.booleans(),
)
async def test_property_exactly_once_aligned_reproducible(
    driver: Any,
    sizes: list[int],
    batch_size: int,
    chunk_mult: int,
    shuffle: bool,
    seed: int,
    world_size: int,
    drop_last: bool,
) -> None:
    n = sum(sizes)
    if split_refused(n, batch_size, world_size, drop_last):
        return  # refused at open, covered by the bad-input tests
    kw = dict(
        batch_size=batch_size,
        chunk_size=batch_size * chunk_mult,
        shuffle=shuffle,
        seed=seed,
        world_size=world_size,
        drop_last=drop_last,
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for attempt in range(2):
            ranks = []
            for rank in range(world_size):
                folder = Path(tmp) / f"{attempt}-{rank}"
                async with driver(sizes, folder, rank=rank, **kw) as drv:
                    ranks.append([await drv.epoch() for _ in range(2)])
            runs.append(ranks)
        for epoch in range(2):
            per_rank = [runs[0][k][epoch] for k in range(world_size)]
            assert len({len(b) for b in per_rank}) == 1
            idx = check_aligned([b for bs in per_rank for b in bs])
            assert len(np.unique(idx)) == len(idx)
            if drop_last:
                assert n - len(idx) < world_size * batch_size
            else:
                np.testing.assert_array_equal(np.sort(idx), np.arange(n))
            for k in range(world_size):  # same seed, same batches
                a = check_aligned(runs[0][k][epoch])
                b = check_aligned(runs[1][k][epoch])
                np.testing.assert_array_equal(a, b)
