"""A ragged top's rows' lengths summarised for the cache sizing (:class:`RowLengths`): every
answer equals the one computed from whole arrays (a prefix-sum array of a row's size in
global order, the lengths sorted longest first), which is how they were computed before; the
arrays are built here only, as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asynchdf5._ragged_tops
from asynchdf5 import HDF5DataLayer, SchemaError
from asynchdf5._ragged_tops import RaggedInfo, RowLengths

from ._files import check_message

Piece = tuple[int, np.ndarray | None]  # a file: its rows, its indptr (None: not the top's)


def pieces_of(files: Sequence[np.ndarray | int]) -> list[Piece]:
    """Files of the given row lengths (an int: a file of that many rows without the top)."""
    out: list[Piece] = []
    for f in files:
        if isinstance(f, int):
            out.append((f, None))
            continue
        indptr = np.zeros(len(f) + 1, np.int64)
        np.cumsum(f, out=indptr[1:])
        out.append((len(f), indptr))
    return out


class Reference:
    """The sizing's answers from whole arrays (8 bytes a row each): a direct transcription."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        held = [np.diff(ip) for _, ip in pieces if ip is not None]
        every = np.concatenate(held) if held else np.zeros(0, np.int64)
        self.largest = np.zeros(len(every) + 1, np.int64)
        np.cumsum(np.sort(every)[::-1], out=self.largest[1:])
        rows = [np.zeros(n, np.int64) if ip is None else np.diff(ip) for n, ip in pieces]
        self.ring = np.zeros(sum(len(r) for r in rows) + 1, np.int64)
        if len(self.ring) > 1:
            np.cumsum(np.concatenate(rows), out=self.ring[1:])
        self.spread = float(np.std(every)) if len(every) else 0.0

    def heap_rows(self, rows: int) -> int:
        return int(self.largest[min(rows, len(self.largest) - 1)])

    def mean_values(self) -> float:
        n = len(self.largest) - 1
        return float(self.largest[-1]) / n if n else 0.0

    def window(self, rows: int) -> int:
        n, ring, total = len(self.ring) - 1, self.ring, int(self.ring[-1])
        window = int(np.max(ring[rows:] - ring[: n + 1 - rows]))
        if rows > 1:
            window = max(window, int(np.max(ring[1:rows] + total - ring[n + 1 - rows : n])))
        return window

    def slot_values(self, rows: int) -> int:
        n = len(self.ring) - 1
        worst = self.heap_rows(rows)
        if rows <= 0 or rows >= n:
            return worst
        drawn = rows * self.mean_values() + 4.0 * self.spread * rows**0.5
        return min(worst, max(self.window(rows), int(np.ceil(drawn))))

    def chunk_values(self, ranges: Sequence[tuple[int, int]]) -> int:
        if not ranges:
            return 0
        b = np.asarray(ranges, np.int64)
        return int(np.sum(self.ring[b[:, 1]] - self.ring[b[:, 0]]))


def check_equal(files: Sequence[np.ndarray | int], ks: Sequence[int] | None = None) -> None:
    """Every answer of the summary equals the reference's, for every ``k`` (or those given)."""
    pieces = pieces_of(files)
    ref = Reference(pieces)
    lengths = RowLengths(pieces)
    info = RaggedInfo("ragged", lengths=lengths)
    n = lengths.n
    assert n == len(ref.ring) - 1 and lengths.total == int(ref.ring[-1])
    # The spread, from a histogram, is np.std's but for rounding; the slot sizes are the same.
    assert lengths.spread == pytest.approx(ref.spread, rel=1e-12, abs=1e-12)
    assert info.mean_values == ref.mean_values()
    every = (
        ks
        if ks is not None
        else range(n + 3)
        if n <= 400
        else sorted(
            {*range(40), *range(n - 40, n + 3), *np.linspace(40, n - 40, 60).astype(int).tolist()}
        )
    )
    for k in every:
        assert info.heap_rows(k) == ref.heap_rows(k), k
        assert info.slot_values(k) == ref.slot_values(k), k
        assert info.slot_values(k) == ref.slot_values(k), k  # asked again: the same
        if 0 < k < n:
            assert lengths.most_in_stretch(k) == ref.window(k), k
    assert np.array_equal(lengths.before(np.arange(n + 1)), ref.ring)
    rng = np.random.default_rng(n)
    for _ in range(5):
        cuts = np.sort(rng.integers(0, n + 1, 2 * int(rng.integers(0, 6))))
        ranges = [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]
        assert info.chunk_values(ranges) == ref.chunk_values(ranges)


rng0 = np.random.default_rng(41)


@pytest.mark.parametrize(
    "files",
    [
        pytest.param([rng0.integers(0, 50, 300)], id="random"),
        pytest.param([rng0.integers(4, 65, 5000)], id="tokens"),
        pytest.param([np.zeros(20, np.int64)], id="all-empty"),
        pytest.param([np.r_[np.zeros(30, np.int64), 10_000, np.ones(30, np.int64)]], id="one-huge"),
        pytest.param([np.sort(rng0.integers(0, 1000, 200))], id="sorted"),
        pytest.param([np.full(100, 7, np.int64)], id="constant"),
        pytest.param([np.tile(np.array([1, 100], np.int64), 64)], id="alternating"),
        pytest.param([np.r_[rng0.integers(0, 3, 40), 2**40, 5, 2**33]], id="beyond-histogram"),
        pytest.param([np.r_[1, np.zeros(99, np.int64)]], id="one-value"),
        pytest.param([np.zeros(0, np.int64), rng0.integers(0, 9, 50)], id="zero-row-file"),
        pytest.param(
            [rng0.integers(0, 20, 40), 25, np.zeros(0, np.int64), rng0.integers(0, 99, 60), 3],
            id="files-without-the-top",
        ),
        pytest.param([17, 4], id="no-file-holds-it"),
        pytest.param([], id="no-file"),
    ],
)
@pytest.mark.parametrize("small", [True, False])  # rows and blocks of starts taken at a time
def test_the_summary_answers_as_the_whole_arrays_did(
    files: list[np.ndarray | int], small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if small:
        monkeypatch.setattr(asynchdf5._ragged_tops, "_BLOCK_ROWS", 3)
        monkeypatch.setattr(asynchdf5._ragged_tops, "_PIECE", 2)
    check_equal(files)


def test_rows_larger_than_a_chunks_budget_and_long_stretches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of many rows over a long top, and rows much longer than a chunk holds: the
    block search (blocks of up to 4096 starts, halved) gives the whole arrays' answer."""
    rng = np.random.default_rng(7)
    lens = rng.integers(4, 65, 200_000)
    lens[rng.integers(0, len(lens), 30)] = 50_000  # rows beyond a chunk's values
    lens[120_000:120_500] = 64  # a stretch of long rows: the most is there
    check_equal([lens[:70_000], 1_000, lens[70_000:]], ks=[1, 2, 255, 256, 4_097, 65_536, 150_000])
    check_equal([lens], ks=[3, 1_000, 100_003, 199_999])
    monkeypatch.setattr(asynchdf5._ragged_tops, "_PIECE", 64)  # many pieces of blocks
    check_equal([lens], ks=[40, 100_003])


def random_files(rows: int) -> st.SearchStrategy[list[np.ndarray | int]]:
    """Up to 4 files, each its rows' lengths (up to ``rows`` rows of 0-300 values) or a number
    of rows of a file without the top."""
    lengths = st.lists(st.integers(0, 300), max_size=rows).map(lambda x: np.array(x, np.int64))
    return st.lists(st.one_of(lengths, st.integers(0, 20)), max_size=4)


@settings(max_examples=80, deadline=None)
@given(random_files(60))
def test_random_files_answer_as_the_whole_arrays_did(files: list[np.ndarray | int]) -> None:
    check_equal(files)


@settings(max_examples=30, deadline=None)
@given(
    random_files(40),
    st.sampled_from([1, 2, 3, 5]),
    st.sampled_from([1, 2, 3]),
)
def test_random_files_in_small_blocks_answer_as_the_whole_arrays_did(
    files: list[np.ndarray | int], block_rows: int, piece: int
) -> None:
    """As above, with ``indptr`` measured and stretches bounded a few rows and blocks at a
    time: the blocks' edges fall anywhere among files of any size (the fixed cases above take
    one block size each)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asynchdf5._ragged_tops, "_BLOCK_ROWS", block_rows)
        mp.setattr(asynchdf5._ragged_tops, "_PIECE", piece)
        check_equal(files)


@pytest.mark.parametrize("at", [0, 2, 3, 7, 8])  # in the first block, at a block's edge, later
def test_indptr_checked_in_blocks_names_the_first_decrease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """``indptr`` is checked a few rows at a time: the first row where it decreases is named,
    whichever block it falls in (blocks of 3 rows here)."""
    monkeypatch.setattr(asynchdf5._ragged_tops, "_BLOCK_ROWS", 3)
    indptr = np.arange(11, dtype=np.int64) * 2
    indptr[at + 1] = indptr[at] - 1
    indptr[at + 2 :] += 10  # later rows rise again; a later decrease is not the first
    indptr[-1] = 40
    path = tmp_path / "down.h5"
    with h5py.File(path, "w") as f:
        f["tok/data"] = np.zeros(40, np.int32)
        f["tok/indptr"] = indptr
        f["label"] = np.arange(10)
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(path, tops=("tok", "label"), batch_size=2).__enter__()
    check_message(err.value, "down.h5", "'tok'", f"decreases at row {at} ")
