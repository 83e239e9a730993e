"""Copying runs of values in blocks (:mod:`asynchdf5._blocks`): every run lands in its place,
whatever its length, dtype or trailing shape, and whatever the path (blocks, value by value,
a slice each)."""

from __future__ import annotations

import numpy as np
import pytest

from asynchdf5._blocks import BLOCK_BYTES, copy_runs, stage_blocks


@pytest.mark.parametrize("longest", [0, 3, 40, 700, 40_000])
@pytest.mark.parametrize("trailing", [(), (3,)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_runs_puts_every_run_in_its_place(
    longest: int, trailing: tuple[int, ...], contiguous: bool
) -> None:
    """Runs read from anywhere in the source (overlapping each other too) and written to
    disjoint places of the destination, with gaps between them left as they were."""
    rng = np.random.default_rng(longest)
    n = 30
    count = rng.integers(0, longest + 1, n)
    width = int(np.prod(trailing))
    values = max(1, int(count.max(initial=0)) * 2)
    source: np.ndarray = np.arange(values * width, dtype=np.int16).reshape(values, *trailing)
    if not contiguous:  # a strided view: copied a slice a run
        source = np.repeat(source, 2, axis=0)[::2]
    start = rng.integers(0, values - count + 1)
    gaps = rng.integers(0, 3, n)
    at = np.cumsum(count + gaps) - count
    dest = np.full((int((count + gaps).sum()), *trailing), -1, np.int16)
    want = dest.copy()
    for a, b, k in zip(start, at, count, strict=True):
        want[b : b + k] = source[a : a + k]
    copy_runs([source], [dest], start.astype(np.int64), at.astype(np.int64), count)
    np.testing.assert_array_equal(dest, want)


def test_block_copies_let_go_of_the_gil() -> None:
    """Each block copy indexes more blocks than NumPy's threshold for letting go of the GIL
    (500 items), whatever the block's bytes: the other gathering thread copies meanwhile."""
    for width in (1, 2, 4, 8, 16, 24):
        for size in BLOCK_BYTES:
            assert stage_blocks(size * width) > 500


def test_copy_runs_over_many_stages() -> None:
    """Thousands of runs, copied in blocks through several temporaries each size."""
    rng = np.random.default_rng(7)
    count = rng.integers(0, 1500, 3000)
    source = rng.integers(0, 2**31, 4_000_000).astype(np.int32)
    start = rng.integers(0, len(source) - count)
    at = np.zeros(len(count), np.int64)
    np.cumsum(count[:-1], out=at[1:])
    dest = np.zeros(int(count.sum()), np.int32)
    copy_runs([source], [dest], start, at, count)
    want = np.concatenate([source[a : a + k] for a, k in zip(start, count, strict=True)])
    np.testing.assert_array_equal(dest, want)


@pytest.mark.parametrize("grain", [4, 12])
def test_runs_of_whole_values_copied_as_bytes_land_in_their_place(grain: int) -> None:
    """Runs of bytes, each whole values of ``grain`` bytes at any byte offset of the source (a
    mapped heap in chunks: :class:`~asynchdf5._read._maps.ChunkHeap`), short and long: each
    lands in its place, the short ones copied a value at a time."""
    rng = np.random.default_rng(grain)
    count = rng.integers(0, 40, 500) * grain
    source = rng.integers(0, 256, 100_000).astype(np.uint8)
    start = rng.integers(0, len(source) - count)  # any byte
    at = np.zeros(len(count), np.int64)
    np.cumsum(count[:-1], out=at[1:])
    dest = np.zeros(int(count.sum()), np.uint8)
    copy_runs([source], [dest], start, at, count, grain=grain)
    want = np.concatenate([source[a : a + k] for a, k in zip(start, count, strict=True)])
    np.testing.assert_array_equal(dest, want)
