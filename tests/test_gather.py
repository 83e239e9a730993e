"""``gather_rows``: the copy of a batch's rows out of a cache slot.

It gathers with ``np.take(..., mode="clip")``, which writes straight into the batch buffer
(numpy's default mode gathers into a temporary first), and checks the bounds itself: a row
outside the slot is an error, never a clipped (wrong) row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, Batch, _gather
from asynchdf5._gather import check_rows, gather_rows
from asynchdf5._plan import ChunkPlan
from asynchdf5._specs import LoadedChunk

from ._files import check_batch, write_source


def _chunk(order: np.ndarray, size: int = 50, first: int = 1000) -> LoadedChunk:
    """A chunk whose slot holds samples ``first..first + size - 1`` (no plan is needed: the
    global indices in serving order come with it)."""
    rows = np.arange(first, first + size)
    arrays = {"data": np.stack([rows, -rows], axis=1), "label": rows.astype(np.int64)}
    return LoadedChunk(cast(Any, None), order, arrays, order + first)


def test_rows_are_gathered_in_serving_order() -> None:
    order = np.random.default_rng(0).permutation(50)
    chunk = _chunk(order)
    out = {"data": np.empty((30, 2), np.int64), "label": np.empty(30, np.int64)}
    indices = np.empty(30, np.int64)
    gather_rows([(chunk, 5, 35)], out, indices)
    want = order[5:35] + 1000
    np.testing.assert_array_equal(indices, want)
    np.testing.assert_array_equal(out["label"], want)
    np.testing.assert_array_equal(out["data"], np.stack([want, -want], axis=1))


@pytest.mark.parametrize("bad", [50, 10**6, -1])
def test_a_row_outside_the_slot_is_an_error_not_a_clipped_row(bad: int) -> None:
    order = np.arange(50)
    order[7] = bad
    out = {"data": np.empty((10, 2), np.int64), "label": np.empty(10, np.int64)}
    with pytest.raises(IndexError):
        gather_rows([(_chunk(order), 0, 10)], out, np.empty(10, np.int64))


def test_check_rows_names_the_top_a_row_is_outside_of() -> None:
    arrays = {"long": np.zeros(10), "short": np.zeros(5)}
    check_rows(np.array([4, 0, 2]), arrays)
    check_rows(np.array([], np.int64), arrays)
    with pytest.raises(IndexError, match=r"rows 0\.\.5 of 5 \(top 'short'\)"):
        check_rows(np.array([5, 0]), arrays)
    with pytest.raises(IndexError, match=r"rows -1\.\.3"):
        check_rows(np.array([3, -1]), arrays)


def test_a_checked_chunk_is_not_checked_again_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(_gather, "check_rows", lambda rows, arrays: calls.append(len(rows)))
    out = {"data": np.empty((10, 2), np.int64), "label": np.empty(10, np.int64)}
    chunk = _chunk(np.random.default_rng(1).permutation(50))
    gather_rows([(chunk, 0, 10)], out, np.empty(10, np.int64))
    assert calls == [10]
    chunk.checked = True
    gather_rows([(chunk, 10, 20)], out, np.empty(10, np.int64))
    assert calls == [10]


@pytest.mark.anyio
@pytest.mark.parametrize("chunk_size", [40, 2**20])  # streamed through slots; resident
async def test_an_order_outside_the_chunk_fails_the_epoch_before_any_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_size: int
) -> None:
    # The loader checks each chunk's rows once, so that the gather need not: a wrong order
    # (here shifted by one, its last row past the slot) must still be an error, not clipped.
    real = ChunkPlan.order

    def shifted(self: ChunkPlan) -> np.ndarray | None:
        order = real(self)
        return None if order is None else order + 1

    monkeypatch.setattr(ChunkPlan, "order", shifted)
    source = write_source(tmp_path)[0]
    got = []
    with anyio.fail_after(30), pytest.raises(IndexError):
        async with AsyncHDF5DataLayer(
            source, batch_size=10, chunk_size=chunk_size, shuffle=True, seed=3, mmap=False
        ) as layer:
            async for batch in layer:
                got.append(batch)
    assert got == []


@pytest.mark.anyio
async def test_a_short_chunks_order_is_checked_against_its_rows_not_its_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 300 samples in chunks of 128: the last chunk has 44 rows in a slot of 128, whose other rows
    # hold an older chunk's samples. An order that points past the 44 must be an error too.
    real = ChunkPlan.order

    def shifted(self: ChunkPlan) -> np.ndarray | None:
        order = real(self)
        return order + 1 if order is not None and self.rows < 128 else order

    monkeypatch.setattr(ChunkPlan, "order", shifted)
    source = write_source(tmp_path)[0]
    got: list[Batch] = []
    with anyio.fail_after(30), pytest.raises(IndexError, match=r"of 44 \(top"):
        async with AsyncHDF5DataLayer(
            source,
            batch_size=4,
            chunk_size=128,
            cache_bytes=2**20,
            shuffle=True,
            seed=3,
            mmap=False,
        ) as layer:
            async for batch in layer:
                got.append(batch)
    for b in got:  # the batches before the error are whole and right
        check_batch(b, 4)
    assert len(got) <= 256 // 4
