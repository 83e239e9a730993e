"""An h5py variable-length top's rows' lengths, read at open a block of rows at a time
(``_ragged_tops._vlen_form``): its ``indptr`` is the one reading every row at once gave, whatever
the rows and wherever the blocks' edges fall (empty rows, a first block of empty rows, one row
larger than a block, no rows, fewer rows than the first block), and no block holds much more
than a block's bytes of values, even where the rows before it were empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynchdf5._ragged_tops as ragged_tops

_NAMES = itertools.count()


@pytest.fixture(scope="module")
def h5() -> Iterator[h5py.File]:
    """A file in memory (nothing written to disk) for the datasets of this module's tests."""
    with h5py.File("vlen-lengths.h5", "w", driver="core", backing_store=False) as f:
        yield f


class Recording:
    """An h5py dataset that records the bytes of values each read of rows held."""

    def __init__(self, dset: h5py.Dataset) -> None:
        self.dset = dset
        self.blocks: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dset, name)

    def __len__(self) -> int:
        return len(self.dset)

    def __getitem__(self, rows: slice) -> np.ndarray:
        out: np.ndarray = self.dset[rows]
        self.blocks.append(sum(r.nbytes for r in out))
        return out


def read_lengths(h5: h5py.File, lengths: list[int]) -> tuple[np.ndarray, list[int]]:
    """A variable-length int16 dataset of rows of ``lengths``: the ``indptr`` read at open, and
    the bytes of values of each block read."""
    name = f"v{next(_NAMES)}"
    dset = h5.create_dataset(name, (len(lengths),), dtype=h5py.vlen_dtype(np.int16))
    for i, k in enumerate(lengths):
        dset[i] = np.arange(k, dtype=np.int16)
    rec = Recording(dset)
    form = ragged_tops._vlen_form("f.h5", name, rec, h5py.check_vlen_dtype(dset.dtype))
    del h5[name]
    return form.indptr, rec.blocks


def whole(lengths: list[int]) -> np.ndarray:
    """The ``indptr`` of reading every row at once."""
    indptr = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.asarray(lengths, np.int64), out=indptr[1:])
    return indptr


@pytest.mark.parametrize(
    "lengths",
    [
        [],
        [0],
        [3, 0, 5],  # fewer rows than the first block
        [0] * 300,
        [0] * 256 + [7] * 40,  # a first block of empty rows
        [0] * 255 + [40000] + [1] * 9,  # one huge row, the first block's last
        [2] * 256 + [0] * 5 + [40000] + [0] * 600,  # one huge row past the first block
    ],
)
def test_lengths_at_the_blocks_edges_are_the_whole_reads(h5: h5py.File, lengths: list[int]) -> None:
    got, _ = read_lengths(h5, lengths)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, whole(lengths))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.just(0), st.integers(0, 6), st.integers(0, 400)), max_size=50),
    st.integers(1, 5),
    st.integers(1, 300),
    st.integers(1, 9),
)
def test_random_rows_in_small_blocks_are_the_whole_reads(
    h5: h5py.File, lengths: list[int], first: int, block: int, most: int
) -> None:
    """Blocks of a few rows and bytes (the first block's rows, a block's bytes, its most rows),
    so that the blocks' edges fall anywhere."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ragged_tops, "_VLEN_FIRST_ROWS", first)
        mp.setattr(ragged_tops, "_VLEN_BLOCK_BYTES", block)
        mp.setattr(ragged_tops, "_VLEN_MOST_ROWS", most)
        got, _ = read_lengths(h5, lengths)
    np.testing.assert_array_equal(got, whole(lengths))


def test_a_block_after_empty_rows_holds_about_a_blocks_bytes(
    h5: h5py.File, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 128 bytes after a first block of empty ones (blocks of 1 KiB, the first of 4
    rows): no block holds more than twice a block's bytes (reading every later row at once, as
    a block sized by the empty rows' bytes would, is what a larger-than-memory top cannot)."""
    monkeypatch.setattr(ragged_tops, "_VLEN_FIRST_ROWS", 4)
    monkeypatch.setattr(ragged_tops, "_VLEN_BLOCK_BYTES", 1024)
    lengths = [0] * 4 + [64] * 300
    got, blocks = read_lengths(h5, lengths)
    np.testing.assert_array_equal(got, whole(lengths))
    assert max(blocks) <= 2 * 1024, blocks
