"""``gather_rows``: the copy of a batch's rows out of a cache slot.

It gathers with ``np.take(..., mode="clip")``, which writes straight into the batch buffer
(numpy's default mode gathers into a temporary first), and checks the bounds itself: a row
outside the slot is an error, never a clipped (wrong) row.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

from asynchdf5._batch import LoadedChunk, gather_rows


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
