"""Host memory: slot sizing within the budget, and batch buffers that are never overwritten while
the consumer holds them."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, Batch, CacheBudgetWarning, MemoryDataLayer
from asynchdf5._catalog import TopInfo
from asynchdf5._delivery import BatchBuffers, line_offset
from asynchdf5._sizing import slot_rows
from asynchdf5._sources import Source

from ._files import IMAGE, write_source

pytestmark = pytest.mark.anyio

TOPS = {"x": TopInfo("x", np.dtype(np.float32), (4,)), "y": TopInfo("y", np.dtype(np.int64), ())}


def test_slot_rows_fit_the_budget_and_warn_when_shrunk() -> None:
    assert slot_rows(1000, 500, 100, 10**9) == 500  # no more than the shard holds
    with pytest.warns(CacheBudgetWarning, match="using chunks of 50 samples"):
        assert slot_rows(1000, 5000, 100, 2 * 50 * 100) == 50


def test_buffers_are_reused_only_once_released() -> None:
    pool = BatchBuffers(TOPS, rows=8, depth=4)
    first = pool.acquire(8)
    held = first["x"]
    del first
    second = pool.acquire(8)
    assert second["x"] is not held  # the consumer still holds `held`
    del held, second
    gc.collect()
    third = pool.acquire(8)
    assert len(pool._pool) == 2  # reused one of the two, allocated nothing new
    view = third["x"][2:4]
    del third
    fourth = pool.acquire(8)
    assert not np.shares_memory(fourth["x"], view)  # a view keeps its buffer in use


def test_partial_batches_are_views_of_pooled_buffers() -> None:
    pool = BatchBuffers(TOPS, rows=8, depth=2)
    part = pool.acquire(3)
    assert part["x"].shape == (3, 4) and part["y"].shape == (3,)


def test_buffers_start_where_their_source_rows_do_within_a_cache_line() -> None:
    for offset in (0, 16, 40):
        pool = BatchBuffers(TOPS, rows=8, depth=2, offsets={"x": offset, "y": offset})
        for _ in range(3):  # fresh and reused buffers alike
            bufs = pool.acquire(8)
            assert line_offset(bufs["x"]) == offset  # float32: any multiple of 4
            assert line_offset(bufs["y"]) == offset - offset % 8  # int64 stays 8-aligned
            assert bufs["x"].flags.c_contiguous and bufs["y"].flags.aligned


async def test_batches_follow_the_alignment_of_what_they_are_gathered_from(
    tmp_path: Path,
) -> None:
    """Cache slots are page-aligned, so streamed batches start on a cache line; a
    ``MemoryDataLayer``'s batches start where the user's arrays do. (Rows of 64 bytes: every
    batch of a group starts at the same offset as the group.)"""
    src, _ = write_source(tmp_path, [700, 300], shape=(16,))
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(src, batch_size=32, shuffle=True, chunk_size=256) as L:
            offsets = {line_offset(b["data"]) async for b in L}
    assert offsets == {0}
    for at in (0, 16, 48):
        raw = np.zeros(1000 * 64 + 128, np.uint8)
        start = (at - line_offset(raw)) % 64
        data = raw[start : start + 1000 * 64].view(np.float32).reshape(1000, 16)
        data[:, 0] = np.arange(1000)
        with anyio.fail_after(30):
            async with MemoryDataLayer(
                data={"data": data, "label": np.arange(1000)}, batch_size=32, shuffle=True
            ) as M:
                batches = [b async for b in M]
        assert {line_offset(b["data"]) for b in batches} == {at}
        for b in batches:  # and they hold the right rows
            np.testing.assert_array_equal(b["data"][:, 0], b.indices)


async def test_kept_batches_stay_intact_across_epochs(tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [700, 300], shape=IMAGE)
    kept = []
    async with AsyncHDF5DataLayer(src, batch_size=32, shuffle=True, seed=0, chunk_size=256) as L:
        for _ in range(3):
            async for i, batch in _enumerate(L):
                if i % 3 == 0:
                    kept.append(batch)
    for b in kept:
        np.testing.assert_array_equal(b["label"], b.indices)
        np.testing.assert_array_equal(b["data"][:, 0, 0], b.indices * 10)


async def test_cache_budget_shrinks_chunks(tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [1000], shape=IMAGE)
    n = 1000
    row = 3 * 4 * 4 + 8
    layer = AsyncHDF5DataLayer(src, batch_size=10, cache_bytes=2 * 100 * row)
    with pytest.warns(CacheBudgetWarning):
        await layer.__aenter__()
    try:
        assert layer.stats.chunk_rows == 100
        seen = np.sort(np.concatenate([b.indices async for b in layer]))
        np.testing.assert_array_equal(seen, np.arange(n))
    finally:
        await layer.aclose()


async def _enumerate(layer: AsyncHDF5DataLayer) -> AsyncIterator[tuple[int, Batch]]:
    i = 0
    async for batch in layer:
        yield i, batch
        i += 1


async def test_a_data_set_that_fits_one_chunk_is_read_once(tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [600, 400], shape=IMAGE)
    n = 1000
    async with AsyncHDF5DataLayer(src, batch_size=64, shuffle=True, seed=1) as layer:
        for _ in range(3):
            idx = np.concatenate([b.indices async for b in layer])
            np.testing.assert_array_equal(np.sort(idx), np.arange(n))
        stats = layer.stats
    assert stats.resident
    assert stats.bytes_read == n * (3 * 4 * 4 + 8)  # every sample once, over three epochs


async def test_streaming_rereads_every_epoch(tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [600, 400], shape=IMAGE)
    n = 1000
    async with AsyncHDF5DataLayer(
        src, batch_size=64, chunk_size=300, shuffle=True, mmap=False
    ) as layer:
        for _ in range(3):
            async for _batch in layer:
                pass
        stats = layer.stats
    assert not stats.resident
    assert stats.bytes_read >= 3 * n * (3 * 4 * 4 + 8)


class _Overlapping(AsyncHDF5DataLayer):
    """The real layer and local source; each chunk's fetch returns only once another fetch has
    been in flight at the same time (the last chunk's at once), so that reads done one after
    the other would wait forever. Whichever of two overlapping fetches ends first."""

    def _source(self) -> Source:
        source = super()._source()
        active: list[anyio.Event] = []  # one per fetch in flight: set once it overlapped another
        calls = [0]
        fetch = source.fetch

        async def overlapping(ranges: Any, *args: Any, **kwargs: Any) -> int:
            me = anyio.Event()
            if active:
                me.set()
                for other in active:
                    other.set()
            active.append(me)
            index = calls[0]
            calls[0] += 1
            try:
                n = await fetch(ranges, *args, **kwargs)
                if index + 1 < self.chunks_to_read:
                    await me.wait()
            finally:
                active.remove(me)
            return n

        source.fetch = overlapping  # type: ignore[method-assign]
        return source

    chunks_to_read = 0


async def test_the_next_chunk_is_read_while_the_one_before_is_still_being_read(
    tmp_path: Path,
) -> None:
    src, _ = write_source(tmp_path, [600, 400], shape=IMAGE)
    n = 1000
    layer = _Overlapping(src, batch_size=50, chunk_size=250, shuffle=True, seed=3)
    layer.chunks_to_read = 4  # the epoch's chunks (a ramped first chunk, then 250 each)
    with anyio.fail_after(20):  # reads one after the other: the first fetch never returns
        async with layer:
            idx = np.concatenate([b.indices async for b in layer])
    np.testing.assert_array_equal(np.sort(idx), np.arange(n))
    assert layer.stats.chunks_read >= 4  # and maybe the next epoch's first, read ahead
