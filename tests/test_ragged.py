"""Ragged and sparse tops (issue 41): rows of varying length through the whole pipeline.

Every file here is written so that a row says which sample it is: row ``g`` (global index) of
the ragged top ``tok`` holds ``length(g)`` values all equal to ``g`` (and, with a trailing
shape, rows of ``g``), so each check ties values, lengths and ``batch.indices`` together.
"""

from __future__ import annotations

import collections
import gc
import itertools
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import h5py
import numpy as np
import numpy.typing as npt
import pytest
import scipy.sparse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asynchdf5
from asynchdf5 import (
    CacheBudgetWarning,
    ConfigurationError,
    HDF5DataLayer,
    Ragged,
    SchemaError,
    Stream,
)
from asynchdf5 import transforms as T
from asynchdf5._ragged import _csr_kind, _pad_windows, csr_batch, pad_rows, padded_rows
from asynchdf5._ragged_tops import RaggedInfo, RowLengths

from ._files import check_exactly_once, check_message
from ._helpers import peak_growth, run_python

pytestmark = pytest.mark.timeout(60)


def lengths_of(start: int, n: int, longest: int = 7) -> np.ndarray:
    """Row lengths of global rows ``start:start+n``: 0 to ``longest``, empty rows included."""
    g = np.arange(start, start + n)
    return ((g * 7919) % (longest + 1)).astype(np.int64)


def write_ragged(
    path: Path,
    start: int,
    n: int,
    *,
    trailing: tuple[int, ...] = (),
    longest: int = 7,
    lengths: np.ndarray | None = None,
    vlen: bool = False,
    indptr_dtype: type[np.signedinteger[Any]] = np.int64,
) -> Path:
    """A file of ``n`` samples from global row ``start``: ``tok`` (ragged: ``data`` +
    ``indptr`` of ``indptr_dtype``, or an h5py vlen dataset), ``label`` (the global index) and
    ``len``."""
    lens = lengths_of(start, n, longest) if lengths is None else lengths
    g = np.arange(start, start + n, dtype=np.int64)
    with h5py.File(path, "w") as f:
        f["label"] = g
        f["len"] = lens
        if vlen:
            d = f.create_dataset("tok", (n,), dtype=h5py.vlen_dtype(np.int64))
            for i in range(n):
                d[i] = np.full(lens[i], g[i])
        else:
            grp = f.create_group("tok")
            data = np.repeat(g, lens)
            grp["data"] = data.reshape(-1, *([1] * len(trailing))) * np.ones(trailing, np.int64)
            indptr = np.zeros(n + 1, np.int64)
            np.cumsum(lens, out=indptr[1:])
            grp["indptr"] = indptr.astype(indptr_dtype)
    return path


def write_files(folder: Path, sizes: Sequence[int], **kw: Any) -> list[Path]:
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append(write_ragged(folder / f"r{k}.h5", start, n, **kw))
        start += n
    return out


def check_rows(batch: Any, trailing: tuple[int, ...] = (), top: str = "tok") -> None:
    """Each row of the ragged top is its sample's: its length and its values."""
    r = batch[top]
    assert isinstance(r, Ragged)
    assert len(r) == len(batch.indices) == len(batch["label"])
    np.testing.assert_array_equal(batch["label"], batch.indices)
    np.testing.assert_array_equal(r.lengths, batch["len"])
    assert r.values.shape[1:] == trailing
    assert r.offsets[0] == 0 and r.offsets[-1] == len(r.values)
    for i, g in enumerate(batch.indices.tolist()):
        assert (r[i] == g).all()


def epoch_of(layer: HDF5DataLayer, trailing: tuple[int, ...] = ()) -> list[int]:
    seen: list[int] = []
    for b in layer:
        check_rows(b, trailing)
        seen += b.indices.tolist()
    return seen


# --- Ragged itself ------------------------------------------------------------------------------


def test_ragged_rows_slices_and_padding() -> None:
    r = Ragged.from_rows([[1, 2, 3], [], [4, 5]], np.int32)
    assert len(r) == 3 and r[-1].tolist() == [4, 5] and r[1].size == 0
    s = r[1:]
    assert isinstance(s, Ragged) and s.offsets.tolist() == [0, 0, 2] and s[1].tolist() == [4, 5]
    x, n = r.to_padded(pad=-1)
    assert x.tolist() == [[1, 2, 3], [-1, -1, -1], [4, 5, -1]] and n.tolist() == [3, 0, 2]
    x, n = r.to_padded(length=2)
    assert x.tolist() == [[1, 2], [0, 0], [4, 5]] and n.tolist() == [2, 0, 2]
    x, n = r.to_padded(length=4, dtype=np.float32)
    assert x.shape == (3, 4) and x.dtype == np.float32
    # A trailing shape pads whole positions.
    t = Ragged(np.arange(6).reshape(3, 2), np.array([0, 1, 3]))
    x, n = t.to_padded()
    assert x.shape == (2, 2, 2) and x[0, 1].tolist() == [0, 0] and x[1].tolist() == [[2, 3], [4, 5]]
    with pytest.raises(IndexError):
        r[3]
    with pytest.raises(ValueError, match="offsets"):
        Ragged(np.arange(3), np.array([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="end at len"):
        Ragged(np.arange(3), np.array([0, 2]))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), max_size=12),
    length=st.none() | st.integers(0, 100),
    trailing=st.sampled_from([(), (2,)]),
)
def test_to_padded_equals_padding_row_by_row(
    lengths: list[int], length: int | None, trailing: tuple[int, ...]
) -> None:
    """Short rows (one index over the values) and long ones (a slice per row) pad alike: each
    row's first values, then ``pad``, cut at ``length``; the lengths returned are the cut ones."""
    values = np.arange(sum(lengths) * max(1, int(np.prod(trailing)))).reshape(-1, *trailing)
    r = Ragged(values, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    size = max(lengths, default=0) if length is None else length
    x, n = r.to_padded(pad=-7, length=length, dtype=np.float64)
    assert x.shape == (len(lengths), size, *trailing) and x.dtype == np.float64
    want = np.full(x.shape, -7.0)
    for i in range(len(lengths)):
        k = min(lengths[i], size)
        want[i, :k] = r[i][:k]
    np.testing.assert_array_equal(x, want)
    assert n.dtype == np.int64 and n.tolist() == [min(k, size) for k in lengths]


#: The dtypes the padding property runs over: the widths padded as bits (1, 2, 4, 8 bytes:
#: ints, floats, bool, complex64, datetimes) and others padded by a masked copy (3-byte strings,
#: complex128).
PAD_DTYPES = ["i1", "u2", "i4", "i8", "f4", "f8", "?", "c8", "M8[s]", "S3", "c16", ">i4"]


def pad_row_by_row(
    values: np.ndarray, starts: np.ndarray, cut: np.ndarray, size: int, pad: Any, dtype: Any
) -> np.ndarray:
    """What padding is: each row's values up to its cut, then ``pad``, a row at a time."""
    want = np.full((len(starts), size, *values.shape[1:]), pad, dtype)
    for i, (a, k) in enumerate(zip(starts.tolist(), cut.tolist(), strict=True)):
        want[i, :k] = values[a : a + k]
    return want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 40), max_size=10),
    length=st.none() | st.integers(0, 50),
    trailing=st.sampled_from([(), (2,), (3, 1)]),
    dtype=st.sampled_from(PAD_DTYPES),
    cast=st.booleans(),
    pad=st.sampled_from([0, 1, 3, 99]),
    seed=st.integers(0, 2**16),
)
def test_to_padded_and_padded_rows_equal_padding_row_by_row(
    lengths: list[int],
    length: int | None,
    trailing: tuple[int, ...],
    dtype: str,
    cast: bool,
    pad: int,
    seed: int,
) -> None:
    """The one-pass padding (every row copied ``size`` values long, what follows its cut
    masked) equals padding row by row for every dtype, trailing shape, pad value, cut and
    empty or zero rows, from random values (a value from a wrong place shows); and
    :func:`padded_rows` does so from rows taken in any order (a shuffled batch's)."""
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    values = rng.integers(-100, 100, (total, *trailing)).astype(dtype)
    to = np.float64 if cast and np.dtype(dtype).kind in "iuf" else None
    r = Ragged(values, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    size = max(lengths, default=0) if length is None else length
    x, n = r.to_padded(pad=pad, length=length, dtype=to)
    cut = np.minimum(r.lengths, size)
    want = pad_row_by_row(values, r.offsets[:-1], cut, size, pad, to or values.dtype)
    assert x.dtype == want.dtype and x.shape == want.shape
    np.testing.assert_array_equal(x, want)
    assert n.dtype == np.int64 and n.tolist() == cut.tolist()
    order = rng.permutation(len(lengths))
    starts = r.offsets[:-1][order]
    fill = np.full((), pad, values.dtype)
    want = pad_row_by_row(values, starts, cut[order], size, pad, fill.dtype)
    np.testing.assert_array_equal(padded_rows(values, starts, cut[order], size, fill), want)
    # The padded gather's kernel, into an array that held other values, by both its ways.
    for windows in (False, True):
        out = np.full_like(want, b"zz") if want.dtype.kind == "S" else np.ones_like(want)
        if windows:
            _pad_windows(values, starts, cut[order], out, fill)
        else:
            pad_rows(values, starts, cut[order], out, pad)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("pad", [0, -5])
def test_padding_in_blocks_of_rows(monkeypatch: pytest.MonkeyPatch, pad: int) -> None:
    """Rows padded a few at a time (masks of 64 bytes at most): every block's rows, from
    rows taken in any order, by to_padded, padded_rows and the padded gather's kernel."""
    monkeypatch.setattr(asynchdf5._ragged, "_MASK_BYTES", 64)
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 30, 101)
    values = rng.integers(-1000, 1000, (int(lengths.sum()), 2)).astype(np.int16)
    r = Ragged(values, np.concatenate([[0], np.cumsum(lengths)]))
    for size in (None, 7):
        x, cut = r.to_padded(pad, size)
        n = x.shape[1]
        np.testing.assert_array_equal(
            x, pad_row_by_row(values, r.offsets[:-1], cut, n, pad, values.dtype)
        )
        order = rng.permutation(len(r))
        starts, c = r.offsets[:-1][order], cut[order]
        want = pad_row_by_row(values, starts, c, n, pad, values.dtype)
        fill = np.full((), pad, values.dtype)
        np.testing.assert_array_equal(padded_rows(values, starts, c, n, fill), want)
        out = np.ones_like(want)
        pad_rows(values, starts, c, out, pad)  # over _WINDOW_ROWS rows: by windows
        np.testing.assert_array_equal(out, want)


def test_to_padded_of_one_huge_row_nan_neighbours_and_strided_values() -> None:
    """One row far longer than the others pads them all to its length; values past the cuts
    that do not cast (NaN to an integer) are not cast; values that are a strided view pad as
    their copy does."""
    fill = np.full((), -1, np.int32)
    rows: list[npt.ArrayLike] = [np.arange(5000.0), [1.0], [5.0, np.nan], np.array([], np.float64)]
    r = Ragged.from_rows(rows)
    x, n = r.to_padded(pad=-1, length=1, dtype=np.int32)  # the NaN is cut off, not cast
    assert n.tolist() == [1, 1, 1, 0] and x.tolist() == [[0], [1], [5], [-1]]
    # Rows taken from among others (a gather's): the NaN after row 0 is in no row taken.
    got = padded_rows(np.array([1.0, np.nan, 2.0]), np.array([0, 2]), np.array([1, 1]), 2, fill)
    assert got.tolist() == [[1, -1], [2, -1]]
    x, n = r.to_padded(pad=7)
    assert x.shape == (4, 5000) and n.tolist() == [5000, 1, 2, 0]
    np.testing.assert_array_equal(x[0], np.arange(5000.0))
    assert x[1, 0] == 1 and (x[1, 1:] == 7).all() and (x[3] == 7).all()
    wide = np.arange(40).reshape(20, 2)
    s = Ragged(wide[:, 1], np.array([0, 4, 20]))  # values a strided view
    np.testing.assert_array_equal(
        s.to_padded(pad=0)[0], Ragged(wide[:, 1].copy(), s.offsets).to_padded()[0]
    )
    none = Ragged(np.empty((0, 3), np.float32), np.zeros(1, np.int64))
    x, n = none.to_padded(length=4)
    assert x.shape == (0, 4, 3) and x.dtype == np.float32 and n.shape == (0,)


def test_pad_and_densify_transformers() -> None:
    r = Ragged.from_rows([[1], [2, 3, 4]], np.int64)
    assert T.Pad(0, length=2)(r).tolist() == [[1, 0], [2, 3]]
    assert T.Pad(9)(r).tolist() == [[1, 9, 9], [2, 3, 4]]
    with pytest.raises(TypeError, match="Ragged"):
        T.Pad()(np.zeros((2, 2)))
    with pytest.raises(ConfigurationError):
        T.Pad(0, length=-1)
    m = scipy.sparse.csr_array(np.array([[0, 1.5], [2.0, 0]]))
    assert T.Densify()(m).tolist() == [[0, 1.5], [2.0, 0]]
    with pytest.raises(TypeError, match="sparse"):
        T.Densify()(np.zeros(2))


# --- ragged groups through the pipeline ---------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("chunk_size", [5, 16, 10_000])
def test_exactly_once_with_empty_rows_and_zero_row_file(
    tmp_path: Path, shuffle: bool, chunk_size: int
) -> None:
    files = write_files(tmp_path, [23, 0, 18, 9])
    with HDF5DataLayer(
        files,
        tops=("tok", "label", "len"),
        batch_size=4,
        shuffle=shuffle,
        seed=3,
        chunk_size=chunk_size,
    ) as layer:
        assert layer.stats.read_paths["tok"] == "ragged-pread"
        firsts = []
        for _ in range(2):
            seen = epoch_of(layer)
            check_exactly_once([seen], 50)
            firsts.append(seen)
        # Stats count the values read: at least every value once (an epoch of int64 + spans).
        assert layer.stats.bytes_read >= 8 * int(sum(lengths_of(0, 50)))
    if shuffle:
        assert firsts[0] != firsts[1]  # a new order per epoch


@pytest.mark.parametrize(
    ("files", "mmap", "path"),
    [
        (1, True, "ragged-mmap"),  # spans a view of the file's indptr, widened per batch
        (3, False, "ragged-pread"),  # spans written from each file's indptr and values base
    ],
)
@pytest.mark.parametrize("chunk_size", [8, 10_000], ids=["streaming", "resident"])
def test_an_int32_indptr_is_kept_as_stored(
    tmp_path: Path, files: int, mmap: bool, path: str, chunk_size: int
) -> None:
    """AnnData's and scipy's int32 ``indptr`` is kept at open as it is (4 bytes a row, not an
    int64 copy of 8), and every reader gives the same rows from it as from an int64 one."""
    sizes = [23, 18, 9][:files] if files > 1 else [50]
    paths = write_files(tmp_path, sizes, indptr_dtype=np.int32)
    kw: dict[str, Any] = dict(tops=("tok", "label", "len"), batch_size=4, chunk_size=chunk_size)
    from asynchdf5._catalog import build_catalog
    from asynchdf5._sources import LocalSource

    source = LocalSource()
    try:
        catalog = build_catalog(source, [str(p) for p in paths], ("tok",))
    finally:
        source.close()
    kept = [f.ragged["tok"].indptr for f in catalog.files]
    assert [ip.dtype for ip in kept] == [np.dtype(np.int32)] * files
    with HDF5DataLayer(paths, shuffle=True, seed=3, mmap=mmap, **kw) as layer:
        assert layer.stats.read_paths["tok"] == path
        assert layer.stats.resident == (chunk_size > sum(sizes))
        for _ in range(2):
            check_exactly_once([epoch_of(layer)], sum(sizes))


def test_spans_in_place_of_an_int32_indptr_reach_the_gather_in_int64() -> None:
    """The mapped reader's spans are a view of the file's indptr, int32 too (one row's, a
    contiguous view, copied): the gather takes each piece's spans in int64 (its runs'
    arithmetic, in bytes, passes 2**31 long before the values do)."""
    from asynchdf5._gather import piece_spans
    from asynchdf5._read._mapped import _spans_of
    from asynchdf5._specs import LoadedChunk

    for indptr in (np.array([0, 2, 2, 5, 9], np.int32), np.array([0, 3], np.int32)):
        spans = _spans_of(indptr)
        n = len(indptr) - 1
        if n > 1:  # no copy at open
            assert spans.dtype == np.int32 and np.shares_memory(spans, indptr)
        rows = np.arange(n)[::-1].copy()  # mapped rows are taken at their global indices
        chunk = LoadedChunk(cast(Any, None), None, {"tok": spans}, rows, rows_are_global=True)
        got = piece_spans(chunk, 0, n, "tok")
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.c_[indptr[:-1], indptr[1:]][rows])


def test_int32_indptrs_are_summed_in_int64() -> None:
    """Files whose int32 ``indptr`` each hold nearly 2**31 values: the values before a row, a
    file's values base and the longest rows are counted past 2**31 (int64), not wrapped."""
    most = np.iinfo(np.int32).max
    one = np.array([0, most - 1, most], np.int32)  # a row of most - 1 values, one of 1
    lengths = RowLengths([(2, one), (3, None), (2, one.copy())])
    assert lengths.total == 2 * most
    assert lengths.file_base(2) == most
    np.testing.assert_array_equal(
        lengths.before(np.array([0, 1, 2, 5, 6, 7])),
        [0, most - 1, most, most, 2 * most - 1, 2 * most],
    )
    assert lengths.longest(2) == 2 * (most - 1)
    assert lengths.most_in_stretch(3) == 2 * most - 1  # rows 6, 0 and 1 on the ring


def test_trailing_shape_and_chunked_compressed_data(tmp_path: Path) -> None:
    path = tmp_path / "atoms.h5"
    n = 30
    lens = lengths_of(0, n)
    g = np.arange(n, dtype=np.int64)
    with h5py.File(path, "w") as f:
        f["label"], f["len"] = g, lens
        grp = f.create_group("tok")
        data = np.repeat(g, lens)[:, None, None] * np.ones((1, 3, 2), np.int64)
        grp.create_dataset("data", data=data, chunks=(5, 3, 2), compression="gzip")
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=indptr[1:])
        grp["indptr"] = indptr
    with HDF5DataLayer(
        path, tops=("tok", "label", "len"), batch_size=7, shuffle=True, chunk_size=8
    ) as layer:
        assert layer.stats.read_paths["tok"] == "ragged-chunks"
        check_exactly_once([epoch_of(layer, (3, 2))], n)


def test_same_order_as_fixed_rows_and_seed(tmp_path: Path) -> None:
    """A ragged top changes nothing of the order: the batches hold the same samples as a layer
    over the fixed tops alone, with the same seed."""
    files = write_files(tmp_path, [40, 25])
    kw: dict[str, Any] = {"batch_size": 6, "shuffle": True, "seed": 11, "chunk_size": 12}
    with HDF5DataLayer(files, tops=("tok", "label", "len"), **kw) as layer:
        ragged = [b.indices.tolist() for b in layer]
    with HDF5DataLayer(files, tops=("label", "len"), **kw) as layer:
        fixed = [b.indices.tolist() for b in layer]
    assert ragged == fixed


def test_shards_have_equal_batch_counts_and_cover_the_epoch(tmp_path: Path) -> None:
    files = write_files(tmp_path, [31, 20])
    seen: list[list[int]] = []
    counts = []
    for rank in range(3):
        with HDF5DataLayer(
            files,
            tops=("tok", "label", "len"),
            batch_size=4,
            shuffle=True,
            seed=2,
            chunk_size=9,
            rank=rank,
            world_size=3,
        ) as layer:
            batches = list(layer)
            for b in batches:
                check_rows(b)
            counts.append(len(batches))
            seen.append([i for b in batches for i in b.indices.tolist()])
    assert len(set(counts)) == 1
    every = [i for s in seen for i in s]
    assert len(every) == len(set(every)) and set(every) <= set(range(51))


def test_exact_resume_mid_epoch(tmp_path: Path) -> None:
    files = write_files(tmp_path, [33, 14])
    kw: dict[str, Any] = {
        "tops": ("tok", "label", "len"),
        "batch_size": 5,
        "shuffle": True,
        "seed": 4,
        "chunk_size": 10,
    }
    with HDF5DataLayer(files, **kw) as layer:
        whole = [b.indices.tolist() for b in layer]
    with HDF5DataLayer(files, **kw) as layer:
        it = iter(layer)
        head = [next(it).indices.tolist() for _ in range(4)]
        state = layer.state_dict()
    assert head + _resumed(files, kw, state) == whole


def _resumed(source: Any, kw: dict[str, Any], state: dict[str, Any]) -> list[list[int]]:
    """The rest of the epoch a new layer serves from ``state`` (each batch's rows checked)."""
    resumed = HDF5DataLayer(source, **kw)
    resumed.load_state_dict(state)
    with resumed:
        tail = []
        for b in resumed:
            check_rows(b)
            tail.append(b.indices.tolist())
    return tail


def test_stream_and_transformers(tmp_path: Path) -> None:
    files = write_files(tmp_path, [13, 8])
    with HDF5DataLayer(
        files,
        tops=("tok", "label", "len"),
        batch_size=8,
        shuffle=True,
        chunk_size=9,
        transformers=[("tok", T.Pad(-1, length=5))],
    ) as layer:
        for b in layer:
            x = b["tok"]
            assert isinstance(x, np.ndarray) and x.shape == (len(b.indices), 5)
            for row, g, n in zip(x, b.indices, b["len"], strict=True):
                k = min(int(n), 5)
                assert (row[:k] == g).all() and (row[k:] == -1).all()
    with HDF5DataLayer(
        files, tops=("tok", "label", "len"), batch_size=8, shuffle=True, chunk_size=9
    ) as layer:
        got = list(itertools.islice(layer.stream(), 6))  # 48 rows: past two epochs of 21
        for b in got:
            assert len(b.indices) == 8
            check_rows(b)


def test_a_ragged_top_in_several_streams(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_files(tmp_path / "a", [12])
    b = [write_ragged(tmp_path / "b" / "r0.h5", 12, 9)]
    with HDF5DataLayer(
        {"a": Stream(a), "b": Stream(b)},
        tops=("tok", "label", "len"),
        batch_size=3,
        shuffle=True,
        chunk_size=4,
    ) as layer:
        seen = []
        for batch in layer:
            check_rows(batch)
            seen += batch.indices.tolist()
        check_exactly_once([seen], 21)


def test_vlen_numeric_dataset(tmp_path: Path) -> None:
    files = [
        write_ragged(tmp_path / "v0.h5", 0, 17, vlen=True),
        write_ragged(tmp_path / "v1.h5", 17, 6, vlen=True),
    ]
    with HDF5DataLayer(
        files, tops=("tok", "label", "len"), batch_size=5, shuffle=True, chunk_size=7
    ) as layer:
        assert layer.stats.read_paths["tok"] == "vlen-h5py"
        check_exactly_once([epoch_of(layer)], 23)


def test_vlen_lengths_span_blocks(tmp_path: Path) -> None:
    """A variable-length dataset's lengths are read at open a block of rows at a time: rows on
    both sides of the blocks' edges (256, then more) keep their own values."""
    path = write_ragged(tmp_path / "v.h5", 0, 700, longest=40, vlen=True)
    with HDF5DataLayer(path, tops=("tok", "label", "len"), batch_size=64, shuffle=True) as layer:
        seen = []
        for batch in layer:
            check_rows(batch)
            seen += batch.indices.tolist()
        check_exactly_once([seen], 700)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_vlen_dataset_opens_in_bounded_memory(tmp_path: Path) -> None:
    """Opening a variable-length top reads its rows' lengths without holding every row at
    once: 48 MiB of rows open within 32 MiB more memory (reading them whole took 48+)."""
    path = tmp_path / "v.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("tok", (3072,), dtype=h5py.vlen_dtype(np.int32))
        d[...] = [np.full(4096, i, np.int32) for i in range(3072)]
    grew = peak_growth(
        "import sys\nfrom asynchdf5 import HDF5DataLayer",
        "with HDF5DataLayer(sys.argv[1], tops=('tok',), batch_size=4, cache_bytes=1 << 20):\n"
        "    pass",
        [path],
        timeout=50,
    )
    assert grew < 32 << 20, f"opening grew the process by {grew >> 20} MiB"


def test_vlen_strings_are_refused_with_the_route(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("text", data=["a", "bc"], dtype=h5py.string_dtype())
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(path, tops=("text",), batch_size=1).__enter__()
    check_message(err.value, "s.h5", "'text'", "strings", "tokenize")


def test_fixed_length_strings_are_refused_as_such(tmp_path: Path) -> None:
    """An `S5` dataset has fixed rows, not ragged ones: the refusal names its dtype, not
    variable-length strings, and says what works."""
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("code", data=np.array([b"abcde", b"fghij"], "S5"))
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(path, tops=("code",), batch_size=1).__enter__()
    check_message(err.value, "s.h5", "'code'", "strings of fixed length", "S5", "integer codes")
    assert "variable-length" not in str(err.value)


# --- sizes: rows larger than a chunk's budget ---------------------------------------------------


def test_one_huge_row_is_served_and_chunks_sized_in_bytes(tmp_path: Path) -> None:
    lens = np.full(40, 200, np.int64)
    lens[17] = 50_000  # 400 kB, more than the rest together: a slot of 40 rows is 464 kB
    path = write_ragged(tmp_path / "huge.h5", 0, 40, lengths=lens)
    layer = HDF5DataLayer(
        path,
        tops=("tok", "label", "len"),
        batch_size=4,
        shuffle=True,
        chunk_size=40,
        cache_bytes=2 * 430_000,  # a slot holds a batch of the longest rows (405 kB)
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", CacheBudgetWarning)
        layer.__enter__()
    try:
        assert any("varying length" in str(w.message) for w in said), said
        for _ in range(2):
            check_exactly_once([epoch_of(layer)], 40)
    finally:
        layer.__exit__(None, None, None)


def test_a_row_larger_than_the_budget_is_a_named_error_at_open(tmp_path: Path) -> None:
    lens = np.full(10, 1, np.int64)
    lens[3] = 100_000
    path = write_ragged(tmp_path / "huge.h5", 0, 10, lengths=lens)
    layer = HDF5DataLayer(
        path, tops=("tok", "label"), batch_size=2, chunk_size=10, cache_bytes=200_000
    )
    with pytest.raises(ConfigurationError) as err:
        layer.__enter__()
    check_message(err.value, "cache_bytes=200000", "longest rows", "ragged")


def test_chunks_are_sized_by_the_values_they_hold_not_the_longest_rows(tmp_path: Path) -> None:
    """Rows of 0 to 100 values: a chunk of k rows holds about 50 k values, the k longest rows
    about 100 k. The slots are sized for the first (the longest rows gave 276-row chunks in
    this budget), and every row is still its sample's, each once, in two shuffled epochs."""
    n = 1000
    lens = ((np.arange(n) * 7919) % 101).astype(np.int64)
    path = write_ragged(tmp_path / "r.h5", 0, n, lengths=lens)
    layer = HDF5DataLayer(
        path,
        tops=("tok", "label", "len"),
        batch_size=8,
        shuffle=True,
        chunk_size=n,
        cache_bytes=400_000,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)
        layer.__enter__()
    try:
        rows = layer.stats.chunk_rows
        longest = int(np.sort(lens)[::-1][:rows].sum())
        assert 2 * (rows * 32 + longest * 8) > 400_000  # not sized by the longest rows
        assert rows >= 400
        for _ in range(2):
            check_exactly_once([epoch_of(layer)], n)
    finally:
        layer.__exit__(None, None, None)


def test_slot_values_bound_every_stretch_and_never_pass_the_longest_rows() -> None:
    """A slot's heap holds any ``k`` contiguous rows (on the ring: a shuffled epoch's rotation
    wraps) and no more than the ``k`` longest rows; empty rows hold nothing."""
    rng = np.random.default_rng(0)
    for lens in (
        rng.integers(0, 50, 300),
        np.zeros(20, np.int64),
        np.r_[np.zeros(30, np.int64), 10_000, np.ones(30, np.int64)],
        np.sort(rng.integers(0, 1000, 200)),
    ):
        ring = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=ring[1:])
        info = RaggedInfo("ragged", lengths=RowLengths([(len(lens), ring)]))
        twice = np.r_[lens, lens]
        for k in (1, 2, 7, len(lens) - 1, len(lens), len(lens) + 5):
            bound = info.slot_values(k)
            assert bound <= info.heap_rows(k)
            stretches = [twice[a : a + min(k, len(lens))].sum() for a in range(len(lens))]
            assert bound >= max(stretches)
            assert info.chunk_values([(0, min(k, len(lens)))]) == lens[:k].sum()


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_chunk_holding_more_values_than_its_slot_grows_the_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """Slots sized for one value (as if every chunk held fewer than the data's do): each
    chunk grows its slot's heaps before it is read into them (one huge row, empty rows, a
    ragged and a sparse-like top), and every row is still its sample's, each once."""
    lens = lengths_of(0, 60, longest=9)
    lens[25] = 20_000  # one huge row, empty rows around it
    files = [
        write_ragged(tmp_path / "a.h5", 0, 40, lengths=lens[:40]),
        write_ragged(tmp_path / "b.h5", 40, 20, lengths=lens[40:]),
    ]
    monkeypatch.setattr(RaggedInfo, "slot_values", lambda self, rows: 1)
    grown: list[int] = []
    fit = asynchdf5._loading.fit_heaps  # type: ignore[attr-defined]

    def counting(*args: Any) -> Any:
        old = fit(*args)
        grown.append(len(old))
        return old

    monkeypatch.setattr(asynchdf5._loading, "fit_heaps", counting)
    with HDF5DataLayer(
        files, tops=("tok", "label", "len"), batch_size=4, shuffle=shuffle, chunk_size=16
    ) as layer:
        for _ in range(2):
            check_exactly_once([epoch_of(layer)], 60)
    assert sum(grown) > 0 and 0 in grown  # grown, then kept for the chunks after


def test_a_state_saved_with_chunks_sized_by_the_longest_rows_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state saved where slots were sized by the longest rows (smaller chunks, another
    order) resumes that run's order exactly: its chunks are adopted from the state."""
    n = 300
    lens = ((np.arange(n) * 7919) % 41).astype(np.int64)
    path = write_ragged(tmp_path / "r.h5", 0, n, lengths=lens)
    kw: dict[str, Any] = {
        "tops": ("tok", "label", "len"),
        "batch_size": 5,
        "shuffle": True,
        "seed": 3,
        "chunk_size": n,
        "cache_bytes": 80_000,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)
        with monkeypatch.context() as old:
            old.setattr(RaggedInfo, "slot_values", RaggedInfo.heap_rows)
            with HDF5DataLayer(path, **kw) as layer:
                saved_rows = layer.stats.chunk_rows
                whole = [b.indices.tolist() for b in layer]
            with HDF5DataLayer(path, **kw) as layer:
                it = iter(layer)
                head = [next(it).indices.tolist() for _ in range(7)]
                state = layer.state_dict()
        with HDF5DataLayer(path, **kw) as layer:
            assert layer.stats.chunk_rows > saved_rows  # this run's own chunks: larger
        tail = _resumed(path, kw, state)
    assert head + tail == whole


# --- sparse matrices ----------------------------------------------------------------------------


def write_csr(path: Path, m: scipy.sparse.csr_array, **attrs: Any) -> Path:
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g["data"], g["indices"], g["indptr"] = m.data, m.indices, m.indptr
        for k, v in {"shape": m.shape, "encoding-type": "csr_matrix", **attrs}.items():
            g.attrs[k] = v
        f["dense"] = m.toarray()
        f["label"] = np.arange(m.shape[0])
    return path


@pytest.mark.parametrize("shuffle", [False, True])
def test_sparse_batches_are_csr_rows_in_batch_order(tmp_path: Path, shuffle: bool) -> None:
    m = scipy.sparse.random(45, 12, density=0.25, format="csr", random_state=0, dtype=np.float32)
    path = write_csr(tmp_path / "m.h5", scipy.sparse.csr_array(m))
    with HDF5DataLayer(
        path, tops=("X", "dense", "label"), batch_size=8, shuffle=shuffle, chunk_size=10, mmap=False
    ) as layer:  # (mapped: tests/test_mmap.py)
        assert layer.stats.read_paths["X"] == "sparse-pread"
        seen = []
        for b in layer:
            x = b["X"]
            assert isinstance(x, scipy.sparse.csr_array) and x.shape == (len(b.indices), 12)
            np.testing.assert_array_equal(x.toarray(), b["dense"])
            seen += b.indices.tolist()
        check_exactly_once([seen], 45)
    with HDF5DataLayer(
        path, tops=("X", "dense"), batch_size=8, transformers=[("X", T.Densify())]
    ) as layer:
        for b in layer:
            np.testing.assert_array_equal(b["X"], b["dense"])


#: Run in a fresh process: scipy.sparse is imported by the opening, not by the first batch.
_IMPORTED_AT_OPEN = """
import sys
from asynchdf5 import HDF5DataLayer
assert "scipy.sparse" not in sys.modules
with HDF5DataLayer(sys.argv[1], tops=("X", "label"), batch_size=4) as layer:
    print("at open:", "scipy.sparse" in sys.modules)
    print("rows:", sum(b["X"].shape[0] for b in layer))
"""


def test_scipy_is_imported_at_open_not_by_the_first_batch(tmp_path: Path) -> None:
    m = scipy.sparse.random(10, 6, density=0.3, format="csr", random_state=3)
    path = write_csr(tmp_path / "m.h5", scipy.sparse.csr_array(m))
    out = run_python(["-c", _IMPORTED_AT_OPEN, path], timeout=60)
    assert out.split() == ["at", "open:", "True", "rows:", "10"], out


def test_a_sparse_top_without_scipy_is_a_named_error_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = scipy.sparse.random(10, 6, density=0.3, format="csr", random_state=3)
    path = write_csr(tmp_path / "m.h5", scipy.sparse.csr_array(m))
    monkeypatch.setitem(sys.modules, "scipy.sparse", None)  # what `import` takes as missing
    with pytest.raises(ConfigurationError) as err:
        HDF5DataLayer(path, tops=("X", "label"), batch_size=4).__enter__()
    check_message(err.value, "top 'X'", "sparse matrix", "scipy", "'sparse' extra")
    with HDF5DataLayer(path, tops=("dense", "label"), batch_size=4) as layer:  # none sparse
        assert sum(len(b["dense"]) for b in layer) == 10


def test_anndata_sparse_h5ad(tmp_path: Path) -> None:
    anndata = pytest.importorskip("anndata")
    import pandas as pd

    m = scipy.sparse.random(60, 9, density=0.3, format="csr", random_state=1, dtype=np.float32)
    obs = pd.DataFrame({"n": np.arange(60)}, index=[f"c{i}" for i in range(60)])
    path = tmp_path / "cells.h5ad"
    anndata.AnnData(X=m, obs=obs).write_h5ad(path)
    dense = m.toarray()
    with HDF5DataLayer(path, tops=("X", "obs/n"), batch_size=16, shuffle=True) as layer:
        seen = []
        for b in layer:
            np.testing.assert_array_equal(b["X"].toarray(), dense[b.indices])
            np.testing.assert_array_equal(b["obs/n"], b.indices)
            seen += b.indices.tolist()
        check_exactly_once([seen], 60)


def test_anndata_sparse_batches_equal_scipy_rows_with_int32_indices(tmp_path: Path) -> None:
    """Each batch of an AnnData CSR ``X`` is, array by array and dtype by dtype, the rows scipy
    itself cuts (``m[rows]``): int32 ``indices`` as stored and int32 ``indptr`` with them, so
    that scipy copies neither (int64 offsets made it upcast the indices to int64)."""
    anndata = pytest.importorskip("anndata")
    m = scipy.sparse.random(70, 11, density=0.3, format="csr", random_state=2, dtype=np.float32)
    m = scipy.sparse.csr_array(m)
    path = tmp_path / "cells.h5ad"
    anndata.AnnData(X=m).write_h5ad(path)
    with h5py.File(path) as f:
        assert f["X/indices"].dtype == np.int32  # AnnData's own choice, which the batch keeps
    with HDF5DataLayer(path, tops=("X",), batch_size=16, shuffle=True, seed=3) as layer:
        seen = []
        for _ in range(2):  # a second epoch: the reused heaps cut alike
            for b in layer:
                x, want = b["X"], m[b.indices]
                assert isinstance(x, scipy.sparse.csr_array) and x.shape == want.shape
                for got, ref in ((x.data, want.data), (x.indices, want.indices)):
                    assert got.dtype == ref.dtype
                    np.testing.assert_array_equal(got, ref)
                assert x.indptr.dtype == np.int32
                np.testing.assert_array_equal(x.indptr, want.indptr)
                seen += b.indices.tolist()
        check_exactly_once([seen[:70]], 70)
        check_exactly_once([seen[70:]], 70)


@pytest.mark.timeout(60)
def test_a_gzipped_sparse_top_decodes_each_stored_chunk_about_once_an_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sparse top gzipped in stored chunks of values (as AnnData stores ``X``), read shuffled
    through a small cache, is laned in parts of a few of its stored chunks where a chunk keeps
    MIN_PLACES lanes, as fixed rows in stored chunks are: its chunks were taken for no rows, the
    lane parts stayed at the floor, about a stored chunk long, and each chunk at a part's edge
    was decoded again (1.8 decodes a stored chunk an epoch here; AnnData's ``X`` of 20,000
    genes out of core: 1.9). The floor scaled down with the stored chunks (16 KiB: 20 rows), so
    that a small file is cut as the large one was. Every row as scipy cuts it, every sample
    once an epoch."""
    from asynchdf5 import _sizing
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._config import MIN_PLACES

    monkeypatch.setattr(_sizing, "MIN_LANE_BYTES", 16 * 2**10)
    n = 30_000  # 100 values a row: a stored chunk of 2,000 values holds 20 rows' values
    m = scipy.sparse.random(n, 400, density=0.25, format="csr", random_state=4, dtype=np.float32)
    m = scipy.sparse.csr_array(m)
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        for name in ("data", "indices"):
            g.create_dataset(name, data=getattr(m, name), chunks=(2_000,), compression="gzip")
        g["indptr"] = m.indptr
        g.attrs["shape"], g.attrs["encoding-type"] = m.shape, "csr_matrix"
        stored = sum(g[name].id.get_num_chunks() for name in ("data", "indices"))
    decoded: collections.deque[None] = collections.deque()  # appended to by decoding threads
    elements, decode_into = ChunkDecoder.elements, ChunkDecoder.decode_into

    def counted(self: ChunkDecoder, *args: Any) -> Any:
        decoded.append(None)
        return elements(self, *args)

    def counted_into(self: ChunkDecoder, *args: Any) -> bool:  # or decoded in place
        done = decode_into(self, *args)
        if done:
            decoded.append(None)
        return done

    monkeypatch.setattr(ChunkDecoder, "elements", counted)
    monkeypatch.setattr(ChunkDecoder, "decode_into", counted_into)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)  # the small cache is the case
        layer = HDF5DataLayer(
            path, tops=("X",), batch_size=256, shuffle=True, seed=2, cache_bytes=8 * 2**20
        )
        with layer:
            assert layer.stats.read_paths["X"] == "sparse-chunks"
            plan = layer._planner.plan(0)
            assert len(plan.chunks) > 4 and not layer.stats.resident
            assert min(len(c.ranges) for c in plan.chunks) >= MIN_PLACES  # the mix is kept
            for _ in range(3):
                seen = []
                for b in layer:
                    x, want = b["X"], m[b.indices]
                    np.testing.assert_array_equal(x.indptr, want.indptr)
                    np.testing.assert_array_equal(x.indices, want.indices)
                    np.testing.assert_array_equal(x.data, want.data)
                    seen.append(b.indices.copy())
                check_exactly_once(seen, n)
            # Decodes an epoch's worth of chunks read (the reader reads the next epoch's first
            # chunks while this one's are served; one may be partly decoded now).
            per_epoch = len(decoded) * len(plan.chunks) / layer.stats.chunks_read
            assert per_epoch <= 1.5 * stored, (per_epoch, stored)


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"chunks": (2_000,), "compression": "gzip"}, 20),  # 2,000 values, 100 a row
        ({"chunks": (2_000,)}, 0),  # unfiltered chunks of whole values: read in place
        ({}, 0),  # contiguous
    ],
    ids=["gzip", "unfiltered", "contiguous"],
)
def test_value_rows_are_the_rows_a_decoded_chunk_of_values_spans(
    tmp_path: Path, kw: dict[str, Any], want: int
) -> None:
    """A sparse top's stored chunks that are decoded whole count for the rows their values
    span on average, weighed by the top's share of a sample's bytes (here nearly all of it,
    beside a label); chunks read in place, and contiguous values, count for none."""
    from asynchdf5._catalog import build_catalog
    from asynchdf5._sizing import value_rows
    from asynchdf5._sources import LocalSource

    m = scipy.sparse.random(1_000, 400, density=0.25, format="csr", random_state=5)
    m = scipy.sparse.csr_array(m.astype(np.float32))
    path = tmp_path / "m.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        for name in ("data", "indices"):
            g.create_dataset(name, data=getattr(m, name), **kw)
        g["indptr"] = m.indptr
        g.attrs["shape"], g.attrs["encoding-type"] = m.shape, "csr_matrix"
        f["label"] = np.arange(1_000)
    source = LocalSource()
    try:
        catalog = build_catalog(source, [str(path)], ("X", "label"))
    finally:
        source.close()
    assert value_rows(catalog) == want


@pytest.mark.parametrize("stored", [np.int64, np.uint32])
def test_sparse_indices_beyond_int32_make_int64_batches(tmp_path: Path, stored: type) -> None:
    """Indices stored in a dtype int32 cannot hold give int64 ``indices`` and ``indptr``."""
    m = scipy.sparse.csr_array(np.arange(40, dtype=np.float32).reshape(10, 4) % 3)
    path = write_csr(tmp_path / "m.h5", m)
    with h5py.File(path, "a") as f:
        indices = f["X/indices"][:].astype(stored)
        del f["X/indices"]
        f["X/indices"] = indices
    with HDF5DataLayer(path, tops=("X", "dense"), batch_size=4, shuffle=True) as layer:
        for b in layer:
            x = b["X"]
            assert x.indices.dtype == x.indptr.dtype == np.int64
            np.testing.assert_array_equal(x.toarray(), b["dense"])


def test_sparse_batch_shares_the_gathered_memory() -> None:
    """A batch cut from a larger heap is a view of it: scipy's prune (scipy/scipy#6902) does not
    copy it, writes go through, and the heap stays referenced while the batch lives."""
    heap = np.arange(400, dtype=np.float32)
    cols = (np.arange(400) % 7).astype(np.int32)
    offsets = np.array([0, 3, 3, 8], np.int32)
    x = csr_batch(heap[100:108], cols[200:208], offsets, 7)
    assert np.shares_memory(x.data, heap) and np.shares_memory(x.indices, cols)
    assert x.data.flags.writeable and x.indices.dtype == np.int32
    want = scipy.sparse.csr_array((heap[100:108].copy(), cols[200:208].copy(), offsets), (3, 7))
    np.testing.assert_array_equal(x.toarray(), want.toarray())
    refs = sys.getrefcount(heap)
    del x
    assert sys.getrefcount(heap) < refs  # the batch held the heap


@pytest.mark.parametrize("index", [np.int32, np.int64, np.int16])
def test_sparse_batch_is_the_matrix_scipy_makes(index: type) -> None:
    """Made without scipy's constructor (int32 arrays) or by it (others), a batch is the matrix
    the constructor makes of the same arrays: its attributes, its dtypes, a full format check,
    arithmetic and a row slice; and it shares the arrays (int32: none copied)."""
    rng = np.random.default_rng(5)
    data = rng.random(40).astype(np.float32)
    cols: np.ndarray = rng.integers(0, 9, 40).astype(index)
    offsets = np.array([0, 0, 6, 6, 25, 40], np.int32 if index != np.int64 else np.int64)
    x = csr_batch(data, cols, offsets, 9)
    want = scipy.sparse.csr_array((data.copy(), cols.copy(), offsets.copy()), shape=(5, 9))
    assert type(x) is type(want) and set(vars(x)) == set(vars(want))
    assert x.shape == (5, 9) and x.dtype == want.dtype and x.indices.dtype == want.indices.dtype
    assert x.indptr.dtype == want.indptr.dtype
    x.check_format(full_check=True)
    np.testing.assert_array_equal(x.toarray(), want.toarray())
    np.testing.assert_array_equal((x @ np.ones(9, np.float32)), want @ np.ones(9, np.float32))
    np.testing.assert_array_equal(x[2:5].toarray(), want[2:5].toarray())
    if index == np.int32:
        assert np.shares_memory(x.data, data) and np.shares_memory(x.indices, cols)


def test_sparse_batch_falls_back_on_a_scipy_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where scipy's constructor sets attributes other than the ones known, batches are made by
    the constructor (equal matrices either way)."""
    data, cols = np.ones(3, np.float32), np.array([0, 2, 1], np.int32)
    offsets = np.array([0, 2, 3], np.int32)
    made = []
    real = scipy.sparse.csr_array.__init__

    def counted(self: Any, *args: Any, **kw: Any) -> None:
        made.append(1)
        real(self, *args, **kw)

    _csr_kind.cache_clear()
    monkeypatch.setattr("asynchdf5._ragged._CSR_ATTRIBUTES", frozenset({"_shape", "data"}))
    monkeypatch.setattr(scipy.sparse.csr_array, "__init__", counted)
    try:
        assert _csr_kind()[1] is None
        made.clear()
        x = csr_batch(data, cols, offsets, 3)
        assert made and x.toarray().tolist() == [[1, 0, 1], [0, 1, 0]]
    finally:
        _csr_kind.cache_clear()


def test_sparse_batch_index_dtype_bounds() -> None:
    """int32 only while the columns and every non-zero of the top fit it."""
    big = RowLengths([(1, np.array([0, 2**31], np.int64))])
    i32 = np.dtype(np.int32)
    assert RaggedInfo("sparse", 10, i32).batch_index_dtype == np.int32
    assert RaggedInfo("sparse", 10, np.dtype(np.int16)).batch_index_dtype == np.int32
    assert RaggedInfo("sparse", 2**31, i32).batch_index_dtype == np.int64
    assert RaggedInfo("sparse", 10, i32, lengths=big).batch_index_dtype == np.int64
    assert RaggedInfo("sparse", 10, np.dtype(np.int64)).batch_index_dtype == np.int64


def _bad(tmp_path: Path, kind: str) -> tuple[Path, str]:
    path = tmp_path / f"{kind}.h5"
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(3)
        g = f.create_group("X")
        if kind == "neither":
            g["values"] = np.arange(3)
            return path, "neither form"
        g["data"] = np.arange(4.0)
        g["indptr"] = {
            "decreasing": [0, 3, 2, 4],
            "short": [0, 1, 2, 3],
            "csc": [0, 1, 2, 4],
            "no_shape": [0, 1, 2, 4],
        }.get(kind, [0, 1, 2, 4])
        if kind in ("csc", "no_shape"):
            g["indices"] = np.array([0, 1, 0, 1])
        if kind == "csc":
            g.attrs["encoding-type"] = "csc_matrix"
            g.attrs["shape"] = (2, 3)
    return path, {
        "decreasing": "decreases at row 1",
        "short": "ends at 3",
        "csc": "CSC sparse matrix (columns compressed)",
        "no_shape": "no 'shape' attribute",
    }[kind]


@pytest.mark.parametrize("kind", ["neither", "decreasing", "short", "csc", "no_shape"])
def test_bad_groups_are_named_errors_at_open(tmp_path: Path, kind: str) -> None:
    path, words = _bad(tmp_path, kind)
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(path, tops=("X",), batch_size=1).__enter__()
    check_message(err.value, f"{kind}.h5", "'X'", words)
    if kind == "csc":  # the route that converts a file without anndata at hand
        check_message(err.value, "asynchdf5 pack FILE OUT_DIR", "as CSR")


def test_a_group_of_no_form_names_its_members_that_are_tops(tmp_path: Path) -> None:
    """AnnData's `obs` (a dataframe group) and a pandas table's group, named as tops: the
    refusal names the members a user can name instead (strings and index groups left out)."""
    path = tmp_path / "frame.h5"
    with h5py.File(path, "w") as f:
        obs = f.create_group("obs")
        obs.attrs["encoding-type"] = "dataframe"
        obs["_index"] = np.array([b"c0", b"c1", b"c2"], dtype=h5py.string_dtype())
        obs["n_genes"] = np.arange(3)
        kind = obs.create_group("cell_type")
        kind.attrs["encoding-type"] = "categorical"
        kind["codes"], kind["categories"] = np.array([0, 1, 0], np.int8), np.array([b"a", b"b"])
        rec = np.zeros(3, [("index", "<i8"), ("values_block_0", "<f8", (2,)), ("s", "S2")])
        f.create_dataset("df/table", data=rec)
        f.create_group("df/_i_table")
    obs = "'obs/cell_type' (categorical), 'obs/n_genes'"
    for top, members in (
        ("obs", obs),
        ("/obs", obs),  # the members named as tops take them, whatever slashes the top has
        ("obs/", obs),
        ("//obs//", obs),
        ("df", "'df/table/index', 'df/table/values_block_0'"),
        ("/df", "'df/table/index', 'df/table/values_block_0'"),
    ):
        with pytest.raises(SchemaError) as err:
            HDF5DataLayer(path, tops=(top,), batch_size=1).__enter__()
        check_message(err.value, repr(top), "neither form", f"Its members that are tops: {members}")
        assert "_index" not in str(err.value).split("tops:")[-1]
        assert "'df/table/s'" not in str(err.value) and "_i_table'" not in str(err.value)


def test_a_member_of_a_csr_group_is_not_a_top(tmp_path: Path) -> None:
    m = scipy.sparse.random(10, 4, density=0.5, format="csr", random_state=2)
    path = write_csr(tmp_path / "m.h5", scipy.sparse.csr_array(m))
    for member in ("X/data", "X/indices"):
        with pytest.raises(SchemaError) as err:
            HDF5DataLayer(path, tops=(member,), batch_size=1).__enter__()
        check_message(err.value, repr(member), "member of the CSR group 'X'", "tops=('X'")


def test_a_member_of_a_ragged_group_is_named_as_such(tmp_path: Path) -> None:
    """A ragged group (no `indices`) is not called a CSR matrix in the member's refusal."""
    path = write_ragged(tmp_path / "r.h5", 0, 6)
    for member in ("tok/data", "tok/indptr"):
        with pytest.raises(SchemaError) as err:
            HDF5DataLayer(path, tops=(member, "label"), batch_size=1).__enter__()
        check_message(err.value, repr(member), "member of the ragged group 'tok'", "tops=('tok'")
        assert "CSR" not in str(err.value)


# --- the whole pipeline, property-style ---------------------------------------------------------


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3).filter(lambda s: sum(s) > 0),
    batch_size=st.integers(1, 9),
    extra=st.integers(0, 30),
    shuffle=st.booleans(),
    longest=st.sampled_from([0, 3, 40]),
    seed=st.integers(0, 3),
)
def test_property_exactly_once_and_aligned(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    batch_size: int,
    extra: int,
    shuffle: bool,
    longest: int,
    seed: int,
) -> None:
    folder = tmp_path_factory.mktemp("prop")
    files = write_files(folder, sizes, longest=longest)
    with HDF5DataLayer(
        files,
        tops=("tok", "label", "len"),
        batch_size=batch_size,
        shuffle=shuffle,
        chunk_size=batch_size + extra,
        seed=seed,
    ) as layer:
        for _ in range(2):
            check_exactly_once([epoch_of(layer)], sum(sizes))


# --- torch --------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
# torch's own unpickling of a sparse tensor from a worker says its checks are off (not ours).
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
def test_torch_padded_with_lengths_and_sparse_csr(tmp_path: Path, workers: int) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files = write_files(tmp_path, [19, 6])
    m = scipy.sparse.random(25, 5, density=0.4, format="csr", random_state=3, dtype=np.float32)
    with h5py.File(files[0], "a") as f, h5py.File(files[1], "a") as g:
        for h, part in ((f, m[:19]), (g, m[19:])):
            x = h.create_group("X")
            x["data"], x["indices"], x["indptr"] = part.data, part.indices, part.indptr
            x.attrs["shape"] = part.shape
            h["dense"] = part.toarray()

    def check(b: dict[str, Any]) -> list[int]:
        padded, lengths = b["tok"]
        assert isinstance(padded, torch.Tensor) and padded.shape[0] == len(b["label"])
        assert lengths.tolist() == b["len"].tolist()
        for row, g, n in zip(padded, b["label"], lengths, strict=True):
            assert (row[:n] == g).all() and (row[n:] == 0).all()
        assert b["X"].layout == torch.sparse_csr
        assert torch.equal(b["X"].to_dense(), b["dense"])
        return list(b["label"].tolist())

    with HDF5IterableDataset(
        files, tops=("tok", "label", "len", "X", "dense"), batch_size=4, shuffle=True
    ) as ds:
        seen = [
            i for b in list(DataLoader(ds, batch_size=None, num_workers=workers)) for i in check(b)
        ]
    check_exactly_once([seen], 25)
    gc.collect()


def test_torch_nested_jagged(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files = write_files(tmp_path, [14])
    with HDF5IterableDataset(
        files, tops=("tok", "label", "len"), batch_size=5, ragged="nested"
    ) as ds:
        for b in DataLoader(ds, batch_size=None):
            t = b["tok"]
            assert t.is_nested
            for row, g, n in zip(t.unbind(), b["label"], b["len"], strict=True):
                assert len(row) == n and (row == g).all()
    with pytest.raises(ConfigurationError, match="ragged"):
        HDF5IterableDataset(files, tops=("tok",), batch_size=5, ragged="jagged")


def test_elastic_resume_on_another_world_size(tmp_path: Path) -> None:
    files = write_files(tmp_path, [29, 18])
    kw: dict[str, Any] = {
        "tops": ("tok", "label", "len"),
        "batch_size": 4,
        "shuffle": True,
        "seed": 5,
        "chunk_size": 12,
    }
    with HDF5DataLayer(files, world_size=1, rank=0, **kw) as layer:
        it = iter(layer)
        head = [i for _ in range(3) for i in next(it).indices.tolist()]
        state = layer.state_dict()
    rest: list[int] = []
    for rank in range(2):
        resumed = HDF5DataLayer(files, world_size=2, rank=rank, **kw)
        resumed.load_state_dict(state)
        with resumed:
            rest += epoch_of(resumed)
    check_exactly_once([head, rest], 47)


def test_shuffled_ragged_rows_mix_class_sorted_data(tmp_path: Path) -> None:
    """The mixing promise (docs/shuffle.md) holds for ragged rows, whose order's blocks are
    sized by their values' bytes: class-sorted rows, a cache of a third of the data."""
    from .test_mixing import BATCH, CLASSES, PROMISE, against_permutation

    n = 40_000
    path = tmp_path / "sorted.h5"
    lens = np.random.default_rng(0).integers(0, 100, n)
    with h5py.File(path, "w") as f:
        g = f.create_group("tok")
        g["data"] = np.zeros(int(lens.sum()), np.int32)
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=indptr[1:])
        g["indptr"] = indptr
        f["label"] = np.arange(n) * CLASSES // n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheBudgetWarning)  # the small cache is the case
        layer = HDF5DataLayer(
            path,
            tops=("tok", "label"),
            batch_size=BATCH,
            shuffle=True,
            seed=1,
            cache_bytes=8_500_000,  # chunks of a third of the data (not resident)
        )
        with layer:
            got = np.concatenate([np.asarray(b["label"]).copy() for b in layer])
    assert np.array_equal(np.sort(got), np.arange(n) * CLASSES // n)
    assert against_permutation(got, n) >= PROMISE


def test_a_top_stored_alike_in_every_file_and_stream(tmp_path: Path) -> None:
    ragged = write_ragged(tmp_path / "r.h5", 0, 5)
    fixed = tmp_path / "f.h5"
    with h5py.File(fixed, "w") as f:
        f["tok"] = np.zeros((4, 3), np.int64)
        f["label"] = np.arange(4)
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer([ragged, fixed], tops=("tok",), batch_size=1).__enter__()
    check_message(err.value, "f.h5", "'tok'", "fixed rows", "ragged")
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(
            {"a": Stream([ragged]), "b": Stream([fixed])}, tops=("tok",), batch_size=1
        ).__enter__()
    check_message(err.value, "'tok'", "stream 'b'", "ragged")


def test_streams_of_different_schemas_refuse_ragged_tops(tmp_path: Path) -> None:
    a = write_ragged(tmp_path / "a.h5", 0, 6)
    b = tmp_path / "b.h5"
    with h5py.File(b, "w") as f:  # 'label' of another dtype: another schema
        g = f.create_group("tok")
        g["data"], g["indptr"] = np.arange(3, dtype=np.int64), np.array([0, 1, 3])
        f["label"] = np.arange(2, dtype=np.int32)
    layer = HDF5DataLayer(
        {"a": Stream([a]), "b": Stream([b])},
        tops=("tok", "label"),
        batch_size=2,
        batch_mode="per_stream",
    )
    with pytest.raises(ConfigurationError) as err:
        layer.__enter__()
    check_message(err.value, "per_stream", "ragged")


@pytest.mark.parametrize("longest", [3, 70, 500, 20_000])  # by value, in blocks, a slice a run
@pytest.mark.parametrize("trailing", [(), (2,), (0,)])
@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.complex128])
def test_copy_spans_in_order(longest: int, trailing: tuple[int, ...], dtype: type) -> None:
    """Rows copied in blocks (the last one of a row overlapping the one before it), a value at
    a time or a slice per run: every value in its place, with a second heap (a sparse top's
    column indices) beside the first."""
    from asynchdf5._gather import _copy_spans

    rng = np.random.default_rng(longest)
    lens = rng.integers(0, longest + 1, 50)
    ip = np.zeros(51, np.int64)
    np.cumsum(lens, out=ip[1:])
    size = int(ip[-1]) * int(np.prod(trailing))
    heap: np.ndarray = (np.arange(size) % 251).astype(dtype).reshape(int(ip[-1]), *trailing)
    other = np.arange(int(ip[-1]), dtype=np.int32)
    for rows in (
        np.concatenate([rng.permutation(25), np.arange(25, 50)]),  # shuffled, then a run
        rng.integers(0, 50, 60),  # rows again, and more rows than the heap holds
    ):
        span = np.stack([ip[rows], ip[rows + 1]], axis=1)
        length = span[:, 1] - span[:, 0]
        total = int(length.sum())
        # The spans' places from 7 on: values before and after them stay as they were.
        places = np.concatenate(([0], np.cumsum(length))) + 7
        dest = np.full((total + 9, *trailing), 99, heap.dtype)
        dest2 = np.full(total + 9, -1, np.int32)
        _copy_spans([heap, other], span, places, [dest, dest2])
        want = np.concatenate([heap[ip[r] : ip[r + 1]] for r in rows])
        np.testing.assert_array_equal(dest[7 : 7 + total], want)
        assert (dest[:7] == 99).all() and (dest[7 + total :] == 99).all()
        want2 = np.concatenate([other[ip[r] : ip[r + 1]] for r in rows])
        np.testing.assert_array_equal(dest2[7 : 7 + total], want2)
        assert (dest2[:7] == -1).all() and (dest2[7 + total :] == -1).all()


def test_a_transformer_may_keep_the_top_ragged_and_batches_print(tmp_path: Path) -> None:
    files = write_files(tmp_path, [9])

    def clip(r: Ragged) -> Ragged:
        return Ragged(np.minimum(r.values, 3), r.offsets)

    with HDF5DataLayer(
        files, tops=("tok", "label", "len"), batch_size=4, transformers=[("tok", clip)]
    ) as layer:
        for b in layer:
            assert "Ragged(" in repr(b)
            np.testing.assert_array_equal(b["tok"].lengths, b["len"])
            for i, g in enumerate(b.indices.tolist()):
                assert (b["tok"][i] == min(g, 3)).all()


def test_h5sparse_attributes_name_the_columns(tmp_path: Path) -> None:
    """h5sparse writes ``h5sparse_format`` and ``h5sparse_shape`` instead of AnnData's attrs."""
    m = scipy.sparse.random(12, 7, density=0.4, format="csr", random_state=4, dtype=np.float64)
    path = tmp_path / "h5sparse.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g["data"], g["indices"], g["indptr"] = m.data, m.indices, m.indptr
        g.attrs["h5sparse_format"] = "csr"
        g.attrs["h5sparse_shape"] = m.shape
        f["dense"] = m.toarray()
    with HDF5DataLayer(path, tops=("X", "dense"), batch_size=5, shuffle=True) as layer:
        for b in layer:
            assert b["X"].shape == (len(b.indices), 7)
            np.testing.assert_array_equal(b["X"].toarray(), b["dense"])


@pytest.mark.parametrize("sparse", [False, True])
def test_kept_batches_stay_intact_while_buffers_are_reused(tmp_path: Path, sparse: bool) -> None:
    """The values' buffers are reused once nothing refers to them: batches (and rows) kept
    across an epoch, and two epochs, hold what they held when they were handed over."""
    files = write_files(tmp_path, [60, 25])
    if sparse:
        for f in files:
            with h5py.File(f, "a") as h:
                n = len(h["label"])
                m = scipy.sparse.csr_array(np.arange(n * 4, dtype=np.float32).reshape(n, 4) % 3)
                g = h.create_group("X")
                g["data"], g["indices"], g["indptr"] = m.data, m.indices, m.indptr
                g.attrs["shape"] = m.shape
                h["dense"] = m.toarray()
    tops = ("tok", "label", "len", *(("X", "dense") if sparse else ()))
    with HDF5DataLayer(files, tops=tops, batch_size=3, shuffle=True, chunk_size=10) as layer:
        kept = [b for _ in range(2) for b in layer]
        rows = [b["tok"][0] for b in kept]
    for b, row in zip(kept, rows, strict=True):
        check_rows(b)
        assert (row == b.indices[0]).all()
        if sparse:
            np.testing.assert_array_equal(b["X"].toarray(), b["dense"])


def test_a_large_ragged_group_is_copied_on_both_gathering_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a transformer the gathering stage is one worker and a helper thread: a group of at
    least ``PARALLEL_BYTES`` of ragged values has the rows of its first half copied on the
    helper (as a fixed top's are), and every row still lands with its sample, exactly once."""
    from asynchdf5 import _gather

    monkeypatch.setattr(_gather, "PARALLEL_BYTES", 2**16)  # small files make small groups
    threads: set[str] = set()
    copy = _gather._copy_spans

    def spy(*args: Any) -> None:
        threads.add(threading.current_thread().name)
        copy(*args)

    monkeypatch.setattr(_gather, "_copy_spans", spy)
    files = write_files(tmp_path, [600, 300], longest=300)
    with HDF5DataLayer(
        files,
        tops=("tok", "label", "len"),
        batch_size=64,
        shuffle=True,
        transformers=[("len", lambda x: x)],
    ) as layer:
        seen = epoch_of(layer)
    check_exactly_once([seen], 900)
    assert threads == {"asynchdf5-gather", "asynchdf5-gather-helper_0"}


@pytest.mark.parametrize("sparse", [False, True])
def test_gather_ragged_on_a_helper_equals_one_thread(sparse: bool) -> None:
    """The rows of a ragged (or sparse) top gathered half on a helper thread, the halves cut
    inside a piece and between pieces: the same offsets and values as on one thread."""
    from concurrent.futures import ThreadPoolExecutor

    from asynchdf5._gather import PARALLEL_BYTES, gather_ragged
    from asynchdf5._ragged_tops import heap_keys
    from asynchdf5._specs import LoadedChunk, Piece

    rng = np.random.default_rng(int(sparse))
    pieces: list[Piece] = []
    for c in range(3):
        lens = rng.integers(0, 2000, 400)
        ip = np.zeros(401, np.int64)
        np.cumsum(lens, out=ip[1:])
        heaps: list[np.ndarray] = [rng.integers(0, 2**31, int(ip[-1])).astype(np.int32)]
        if sparse:
            heaps.append(rng.random(int(ip[-1]), np.float32))
        arrays: dict[str, np.ndarray] = {"X": np.stack([ip[:-1], ip[1:]], axis=1)}
        arrays.update(zip(heap_keys("X", sparse), heaps, strict=True))
        order = rng.permutation(400)
        chunk = LoadedChunk(cast(Any, None), order, arrays, order + 400 * c)
        pieces += [(chunk, 0, 150), (chunk, 150, 400)]
    offsets, outs = gather_ragged(pieces, "X", sparse)
    assert sum(o.nbytes for o in outs) >= 2 * PARALLEL_BYTES
    with ThreadPoolExecutor(1) as helper:
        offsets2, outs2 = gather_ragged(pieces, "X", sparse, helper=helper)
    np.testing.assert_array_equal(offsets, offsets2)
    for a, b in zip(outs, outs2, strict=True):
        np.testing.assert_array_equal(a, b)
    for k, out in zip(heap_keys("X", sparse), outs, strict=True):
        want = [
            c.arrays[k][s:e]
            for c, a, b in pieces
            for s, e in c.arrays["X"][c.order[a:b]]  # type: ignore[union-attr,index]
        ]
        np.testing.assert_array_equal(out, np.concatenate(want))


def test_to_padded_of_python_objects_pads_each_row() -> None:
    """Rows of Python objects, or numbers padded into an object array, are padded a row at a
    time (references are copied as references, not as bytes)."""
    words = Ragged(np.array(["a", "b", "c", "d"], object), np.array([0, 3, 3, 4]))
    x, lengths = words.to_padded(pad="-")
    assert x.dtype == object and x.tolist() == [["a", "b", "c"], ["-"] * 3, ["d", "-", "-"]]
    assert lengths.tolist() == [3, 0, 1]
    x, _ = Ragged(np.arange(5), np.array([0, 2, 5])).to_padded(pad=None, length=2, dtype=object)
    assert x.tolist() == [[0, 1], [2, 3]]
    x, _ = Ragged(np.arange(5), np.array([0, 2, 5])).to_padded(pad=None, dtype=object)
    assert x.tolist() == [[0, 1, None], [2, 3, 4]]


# --- a batch's keys ------------------------------------------------------------------------------


def test_batch_keys_follow_the_tops_order(tmp_path: Path) -> None:
    """A batch's keys are the tops in the order given, ragged ones among fixed ones, on every
    route: sync, async, ``stream()``, a fused Pad, the torch dataset (in a worker too), and
    ``process=True`` (in another order; tests/test_process_ragged.py has the rest of it)."""
    import anyio

    files = write_files(tmp_path, [9, 4])
    tops = ("len", "tok", "label")

    def check(keys: Iterable[str], want: Sequence[str] = tops) -> None:
        assert list(keys) == list(want)

    with HDF5DataLayer(files, tops=tops, batch_size=4, shuffle=True) as layer:
        for b in layer:
            check(b)
        for b in itertools.islice(layer.stream(), 5):
            check(b)
    padded = [("tok", T.Pad(0))]
    with HDF5DataLayer(files, tops=tops, batch_size=4, transformers=padded) as layer:
        for b in layer:
            check(b)

    async def run_async() -> None:
        with anyio.fail_after(30):
            async with asynchdf5.AsyncHDF5DataLayer(files, tops=tops, batch_size=4) as layer:
                async for b in layer:
                    check(b)

    anyio.run(run_async)
    other = ("label", "tok", "len")  # not in the files' nor the alphabet's order
    with HDF5DataLayer(files, tops=other, batch_size=4, process=True) as layer:
        for b in layer:
            check(b, other)
            check_rows(b)

    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    for workers in (0, 1):
        with HDF5IterableDataset(files, tops=tops, batch_size=4) as ds:
            for d in DataLoader(ds, batch_size=None, num_workers=workers):
                check(d)


@pytest.mark.parametrize("sparse", [False, True])
def test_gather_ragged_of_every_kind_of_piece_into_reused_buffers(sparse: bool) -> None:
    """Pieces of every kind in one gather: a carry, a shuffled chunk, a chunk in slot order
    (rows that continue each other), rows at global indices whose spans are a view of
    ``indptr`` (a mapped top's), a piece of no rows; rows of no values among them. Gathered
    twice into buffers that are reused (dirty) and the second gather smaller: every row of
    every heap is its own, and the offsets are the call's own array, not the buffers'."""
    from asynchdf5._gather import gather_ragged
    from asynchdf5._ragged_tops import heap_keys
    from asynchdf5._specs import Carry, LoadedChunk, Piece

    rng = np.random.default_rng(5 + int(sparse))
    keys = heap_keys("X", sparse)

    def heaps_of(lens: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        ip = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=ip[1:])
        arrays: dict[str, np.ndarray] = {
            keys[0]: rng.integers(0, 2**31, int(ip[-1])).astype(np.int32)
        }
        if sparse:
            arrays[keys[1]] = rng.random(int(ip[-1]), np.float32)
        return ip, arrays

    def lengths(n: int) -> np.ndarray:
        lens = rng.integers(0, 300, n)
        lens[rng.integers(0, n, n // 5)] = 0  # rows of no values
        return lens

    chunks: list[LoadedChunk | Carry] = []
    for kind in ("carry", "shuffled", "slot order", "mapped"):
        ip, arrays = heaps_of(lengths(120))
        spans = np.stack([ip[:-1], ip[1:]], axis=1)
        if kind == "mapped":  # spans a strided view of indptr, rows at global indices
            spans = np.lib.stride_tricks.as_strided(ip, (120, 2), (8, 8), writeable=False)
        arrays["X"] = spans
        indices = rng.permutation(120)
        if kind == "carry":
            chunks.append(Carry(arrays, indices))
        else:
            order = None if kind == "slot order" else rng.permutation(120)
            chunks.append(
                LoadedChunk(
                    cast(Any, None),
                    order,
                    arrays,
                    indices if kind == "mapped" else np.arange(120),
                    rows_are_global=kind == "mapped",
                )
            )
    pool = [np.empty(2**20, np.uint8) for _ in keys]  # a buffer per heap, reused
    calls = itertools.count()

    def empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        buf = pool[next(calls) % len(keys)]
        buf[:] = 0xAB  # what an earlier batch left there
        return buf[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def rows_of(chunk: LoadedChunk | Carry, a: int, b: int) -> np.ndarray:
        if isinstance(chunk, Carry):
            return np.arange(a, b)
        if chunk.rows_are_global:
            return chunk.indices[a:b]
        return np.arange(a, b) if chunk.order is None else chunk.order[a:b]

    for pieces in (
        [(c, 10, 110) for c in chunks] + [(chunks[1], 5, 5)],
        [(chunks[3], 0, 40), (chunks[0], 60, 60), (chunks[2], 3, 50), (chunks[1], 90, 120)],
    ):
        typed: list[Piece] = list(pieces)
        offsets, outs = gather_ragged(typed, "X", sparse, empty)
        assert not any(np.shares_memory(offsets, buf) for buf in pool)
        taken = [np.asarray(c.arrays["X"])[rows_of(c, a, b)] for c, a, b in pieces]
        lens = np.concatenate([s[:, 1] - s[:, 0] for s in taken])
        np.testing.assert_array_equal(offsets, np.concatenate(([0], np.cumsum(lens))))
        for k, out in zip(keys, outs, strict=True):
            want = [
                np.asarray(c.arrays[k])[s:e]
                for (c, _, _), span in zip(pieces, taken, strict=True)
                for s, e in span.tolist()
            ]
            np.testing.assert_array_equal(out, np.concatenate(want))
