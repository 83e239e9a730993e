"""Ragged and sparse tops at their edges, through the whole pipeline (issue 41's guarantees).

What tests/test_ragged.py checks on middling files, here on the files a user may really have:
rows that vary wildly (one huge row on one shard, files of empty rows only, a file of zero
rows), ``indptr`` of every integer width, values spread over many compressed stored chunks,
elastic resume and weighted streams with ragged and sparse tops side by side, files AnnData
wrote, and files tampered with where the open-time checks cannot see (a column index of a
sparse matrix out of range): a named error before any wrong batch, never a batch.

Row ``g`` (global index) of ``tok`` holds ``len[g]`` values all equal to ``g``; row ``g`` of
the sparse top ``X`` is row ``g`` of the dense top ``dense``: each batch says whether it is
right from its own arrays.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest
import scipy.sparse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    HDF5DataLayer,
    MemoryDataLayer,
    Ragged,
    ReadError,
    SchemaError,
    Stream,
)
from asynchdf5._delivery._cuda import CudaDelivery
from asynchdf5._ragged_tops import RaggedInfo, RowLengths

from ._fake_cupy import FakeCupy
from ._files import check_exactly_once, check_message
from ._helpers import examples
from .test_faults import rewrite_in_place
from .test_ragged import check_rows, lengths_of

pytestmark = pytest.mark.timeout(60)

TOPS = ("tok", "X", "dense", "label", "len")
COLS = 6


def write_both(
    path: Path,
    start: int,
    lens: np.ndarray,
    *,
    ipdtype: Any = np.int64,
    x_lens: np.ndarray | None = None,
    cols: int = COLS,
    vlen: bool = False,
    **datasets: Any,
) -> Path:
    """A file of ``len(lens)`` samples from global row ``start``: the ragged ``tok`` (an
    ``indptr`` of ``ipdtype``), the sparse ``X`` (``x_lens`` non-zeros a row, by default as
    many as ``tok``'s values up to ``cols``, of values ``g + column / 10``; ``cols`` columns)
    and its ``dense`` rows, ``label`` and ``len``; ``vlen``: ``tok``'s rows again as the h5py
    variable-length dataset ``vl``."""
    n = len(lens)
    g = np.arange(start, start + n, dtype=np.int64)
    x_lens = np.minimum(lens, cols) if x_lens is None else x_lens
    assert int(np.max(x_lens, initial=0)) <= cols
    columns = np.concatenate(
        [np.arange(k, dtype=np.int32) for k in x_lens] or [np.zeros(0, np.int32)]
    )
    vals = (np.repeat(g, x_lens) + columns / 10).astype(np.float32)
    m = scipy.sparse.csr_array(
        (vals, columns, np.r_[0, np.cumsum(x_lens)].astype(ipdtype)), shape=(n, cols)
    )
    with h5py.File(path, "w") as f:
        f["label"], f["len"] = g, lens
        t = f.create_group("tok")
        t.create_dataset("data", data=np.repeat(g, lens), **datasets)
        t["indptr"] = np.r_[0, np.cumsum(lens)].astype(ipdtype)
        x = f.create_group("X")
        x.create_dataset("data", data=m.data, **datasets)
        x.create_dataset("indices", data=m.indices, **datasets)
        x["indptr"] = np.r_[0, np.cumsum(x_lens)].astype(ipdtype)
        x.attrs["shape"], x.attrs["encoding-type"] = m.shape, "csr_matrix"
        f["dense"] = m.toarray()
        if vlen:
            d = f.create_dataset("vl", (n,), dtype=h5py.vlen_dtype(np.int64))
            for i in range(n):
                d[i] = np.full(lens[i], g[i])
    return path


def write_all(folder: Path, lens: Sequence[np.ndarray], **kw: Any) -> list[Path]:
    out, start = [], 0
    for k, part in enumerate(lens):
        out.append(write_both(folder / f"f{k}.h5", start, np.asarray(part, np.int64), **kw))
        start += len(part)
    return out


def check_both(batch: Any) -> list[int]:
    """The ragged rows are their samples' (:func:`check_rows`), and so are the sparse ones."""
    check_rows(batch)
    if "vl" in batch:
        check_rows(batch, top="vl")
    x = batch["X"]
    assert isinstance(x, scipy.sparse.csr_array) and x.shape == (len(batch.indices), COLS)
    np.testing.assert_array_equal(x.toarray(), batch["dense"])
    return list(batch.indices.tolist())


# --- sizes at their edges -----------------------------------------------------------------------


@pytest.mark.parametrize(("shuffle", "vlen"), [(False, False), (True, False), (True, True)])
def test_files_of_empty_rows_and_of_zero_rows_beside_others(
    tmp_path: Path, shuffle: bool, vlen: bool
) -> None:
    """A file whose rows are all empty (no values at all), a file of zero rows and a file of
    one row, beside ordinary ones: every sample once an epoch, each row its own."""
    parts = [np.zeros(9, np.int64), np.zeros(0, np.int64), lengths_of(9, 14), np.array([3])]
    files = write_all(tmp_path, parts, vlen=vlen)
    tops = (*TOPS, "vl") if vlen else TOPS
    with HDF5DataLayer(files, tops=tops, batch_size=4, shuffle=shuffle, chunk_size=6) as layer:
        for _ in range(2):
            check_exactly_once([[i for b in layer for i in check_both(b)]], 24)
    (tmp_path / "alone").mkdir()
    alone = write_all(tmp_path / "alone", [np.zeros(7, np.int64)], vlen=vlen)
    with HDF5DataLayer(alone, tops=tops, batch_size=3, shuffle=shuffle) as layer:
        seen = []
        for b in layer:
            seen += check_both(b)
            padded, lengths = b["tok"].to_padded()
            assert padded.shape == (len(b.indices), 0) and not lengths.any()
        check_exactly_once([seen], 7)


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_have_equal_batch_counts_with_one_huge_row_on_one(
    tmp_path: Path, drop_last: bool
) -> None:
    """One row holds more values than all the others together, on one shard: the shards
    still have equal batch counts and together cover the epoch, each sample once (with
    ``drop_last``, full batches, 36 of the 40 samples)."""
    lens = lengths_of(0, 40, longest=5)
    lens[7] = 30_000
    files = write_all(tmp_path, [lens[:25], lens[25:]])
    counts, seen = [], []
    for rank in range(3):
        with HDF5DataLayer(
            files,
            tops=TOPS,
            batch_size=4,
            shuffle=True,
            seed=1,
            rank=rank,
            world_size=3,
            drop_last=drop_last,
        ) as layer:
            batches = [check_both(b) for b in layer]
        counts.append(len(batches))
        seen += [i for b in batches for i in b]
        if drop_last:
            assert all(len(b) == 4 for b in batches)
    assert len(set(counts)) == 1, counts
    assert len(seen) == len(set(seen)) and set(seen) <= set(range(40))
    if drop_last:
        assert len(seen) == 36
    else:
        check_exactly_once([seen], 40)  # the huge row among them


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int16, np.uint64])
def test_indptr_of_every_integer_width(tmp_path: Path, dtype: Any) -> None:
    """``indptr`` of int32 (AnnData's), unsigned or narrow integers reads as int64 does."""
    lens = [lengths_of(0, 17), lengths_of(17, 11)]
    files = write_all(tmp_path, lens, ipdtype=dtype)
    with HDF5DataLayer(files, tops=TOPS, batch_size=5, shuffle=True, chunk_size=7) as layer:
        check_exactly_once([[i for b in layer for i in check_both(b)]], 28)
        # Stats count what was read: every value of tok (int64), every non-zero of X (float32
        # and int32) and the fixed rows, at least once; the samples and batches served.
        values = int(sum(p.sum() for p in lens))
        non_zeros = int(sum(np.minimum(p, COLS).sum() for p in lens))
        fixed = 28 * (COLS * 4 + 8 + 8)
        assert layer.stats.bytes_read >= 8 * values + 8 * non_zeros + fixed
        assert layer.stats.samples == 28 and layer.stats.batches == 6


@pytest.mark.parametrize("mmap", [False, True])
def test_rows_across_many_stored_chunks_of_gzipped_values(tmp_path: Path, mmap: bool) -> None:
    """Rows of up to 60 values in gzipped stored chunks of 7: most rows cross several chunks,
    and a chunk holds the ends of several rows; shuffled through small cache chunks."""
    lens = lengths_of(0, 50, longest=60)
    path = write_both(tmp_path / "gz.h5", 0, lens, compression="gzip", chunks=(7,))
    with HDF5DataLayer(
        path, tops=TOPS, batch_size=6, shuffle=True, chunk_size=9, mmap=mmap
    ) as layer:
        assert layer.stats.read_paths["tok"] == "ragged-chunks"
        assert layer.stats.read_paths["X"] == "sparse-chunks"
        for _ in range(2):
            check_exactly_once([[i for b in layer for i in check_both(b)]], 50)


# --- resume, streams, stream() ------------------------------------------------------------------


@pytest.mark.parametrize("vlen", [False, True])
def test_elastic_resume_from_two_ranks_to_three(tmp_path: Path, vlen: bool) -> None:
    """A state saved by both ranks of a 2-rank run (ragged and sparse tops, a huge row, empty
    rows), loaded on 3 ranks: the rest of the epoch is every sample not yet yielded, once,
    with equal batch counts, each row its own."""
    lens = lengths_of(0, 61, longest=9)
    lens[40] = 5_000
    files = write_all(tmp_path, [lens[:33], lens[33:]], vlen=vlen)
    tops = (*TOPS, "vl") if vlen else TOPS
    kw: dict[str, Any] = {"tops": tops, "batch_size": 4, "shuffle": True, "seed": 7}
    kw["chunk_size"] = 10
    before, states = [], []
    for rank in range(2):
        with HDF5DataLayer(files, rank=rank, world_size=2, **kw) as layer:
            it = iter(layer)
            before += [i for _ in range(3) for i in check_both(next(it))]
            states.append(layer.state_dict())
    after, counts = [], []
    for rank in range(3):
        resumed = HDF5DataLayer(files, rank=rank, world_size=3, **kw)
        resumed.load_state_dict(states[rank % 2])
        with resumed:
            batches = [check_both(b) for b in resumed]
        counts.append(len(batches))
        after += [i for b in batches for i in b]
    assert len(set(counts)) == 1, counts
    check_exactly_once([before, after], 61)


def test_a_ragged_and_sparse_top_in_weighted_streams(tmp_path: Path) -> None:
    """Stream ``a`` upsampled (20 of its 12 samples an epoch), ``b`` downsampled (5 of 9):
    each stream gives its count, ``a`` every sample at least once an epoch, ``b`` each of its
    samples once in its walk's first pass, every row its own."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_all(tmp_path / "a", [lengths_of(0, 12)])
    b = [write_both(tmp_path / "b" / "f.h5", 12, lengths_of(12, 9))]
    with HDF5DataLayer(
        {"a": Stream(a, choose=20), "b": Stream(b, choose=5)},
        tops=TOPS,
        batch_size=5,
        shuffle=True,
        seed=2,
        chunk_size=6,
    ) as layer:
        walked: list[int] = []
        for _ in range(2):
            seen = [i for batch in layer for i in check_both(batch)]
            from_a = [i for i in seen if i < 12]
            from_b = [i for i in seen if i >= 12]
            assert len(from_a) == 20 and set(from_a) == set(range(12))
            assert len(from_b) == 5
            walked += from_b
    # b's walk goes on across epochs (docs/mixing.md): 5 of its first pass, then the 4 left
    # of it beside one of the next pass.
    assert len(set(walked[:5])) == 5 and set(walked) == set(range(12, 21))


def test_stream_with_a_sparse_top(tmp_path: Path) -> None:
    """`stream()` over ragged and sparse tops: full batches across epoch boundaries, each row
    its own, every sample once per epoch of samples."""
    files = write_all(tmp_path, [lengths_of(0, 13), lengths_of(13, 8)])
    with HDF5DataLayer(files, tops=TOPS, batch_size=7, shuffle=True, chunk_size=9) as layer:
        got = [check_both(b) for b in itertools.islice(layer.stream(), 9)]  # 63 = 3 x 21
    assert all(len(b) == 7 for b in got)
    flat = [i for b in got for i in b]
    for k in range(3):
        check_exactly_once([flat[21 * k : 21 * (k + 1)]], 21)


# --- tampered files: named errors, never a wrong batch ------------------------------------------


def _tamper_columns(path: Path, kind: str, row: int) -> None:
    """Make ``X`` of ``path`` out of range at its row ``row`` (which holds values): a column
    index past the last column, equal to the columns (the first out of range) or negative, or a
    ``shape`` with fewer columns than stored."""
    with h5py.File(path, "a") as f:
        x = f["X"]
        if kind == "narrow":
            x.attrs["shape"] = (x.attrs["shape"][0], 1)
            return
        at = int(x["indptr"][row])
        x["indices"][at] = {"past": COLS + 3, "at columns": COLS}.get(kind, -1)


@pytest.mark.parametrize("kind", ["past", "at columns", "negative", "narrow"])
@pytest.mark.parametrize(
    "where", ["mapped", "copied", "second file", "a batch's last row", "process", "gzip"]
)
def test_a_column_index_out_of_range_is_a_read_error_before_its_batch(
    tmp_path: Path, kind: str, where: str
) -> None:
    """Column indices are values, not checked at open: one out of range made a matrix that
    scipy's ``toarray`` wrote outside of (the heap corrupted, the process aborted). The batch
    that holds it is a ReadError naming the file, the top and the row, on every read path; the
    batches before it are right."""
    lens = np.full(30, 3, np.int64)
    if where == "second file":
        files = write_all(tmp_path, [lens[:18], lens[18:]])
        bad, row, g = files[1], 4, 22
    elif where == "a batch's last row":  # 12:16 is a batch of 4, in order
        files = write_all(tmp_path, [lens])
        bad, row, g = files[0], 15, 15
    elif where == "gzip":  # decoded a chunk at a time
        files = write_all(tmp_path, [lens], compression="gzip", chunks=(8,))
        bad, row, g = files[0], 13, 13
    else:
        files = write_all(tmp_path, [lens])
        bad, row, g = files[0], 13, 13
    _tamper_columns(bad, kind, row)
    if kind == "narrow" and where == "second file":  # unlike the first: refused at open
        with pytest.raises(SchemaError) as refused:
            HDF5DataLayer(files, tops=TOPS, batch_size=4).__enter__()
        check_message(refused.value, bad.name, "top 'X'", "sparse of 1 columns", "6 columns")
        return
    if kind == "narrow":
        row, g = 0, g - row  # every row of the file is out of range: its first is named
    layer = HDF5DataLayer(
        files,
        tops=TOPS,
        batch_size=4,
        chunk_size=8,
        mmap=where == "mapped",
        process=where == "process",
    )
    good = []
    with layer, pytest.raises(ReadError) as err:
        for b in layer:
            x = b["X"]
            assert int(x.indices.max()) < COLS and int(x.indices.min()) >= 0  # never given
            good += check_both(b)
    path = {"mapped": "sparse-mmap", "gzip": "sparse-chunks"}.get(where, "sparse-pread")
    assert layer.stats.read_paths["X"] == path
    check_message(err.value, bad.name, "top 'X'", f"row {row} ", f"global index {g})", "column")
    assert g not in good and len(good) >= 4 * (g // 4) - 8


@pytest.mark.anyio
async def test_a_column_index_out_of_range_never_reaches_the_device(
    tmp_path: Path, fake_cupy: FakeCupy
) -> None:
    """With ``device=``, the batch that holds it is the same ReadError, raised before its
    upload, and its staging is given back."""
    files = write_all(tmp_path, [np.full(20, 2, np.int64)])
    _tamper_columns(files[0], "past", 9)
    layer = AsyncHDF5DataLayer(files, tops=("X", "label"), batch_size=4, device="cuda")
    async with layer:
        with anyio.fail_after(30), pytest.raises(ReadError) as err:
            async for b in layer:
                assert 9 not in b["label"].tolist()
        check_message(err.value, "f0.h5", "top 'X'", "row 9 ", "column index 9 ")
        stage = layer._delivery
        assert isinstance(stage, CudaDelivery) and stage._gpu is not None
        with anyio.fail_after(10):
            while stage._gpu.staging._lent:
                await anyio.sleep(0.005)


@pytest.mark.parametrize("encoding", ["group", "before 0.8"])
@pytest.mark.parametrize("code", [2, 100, -2])
def test_a_code_past_the_categories_is_a_named_error_at_open(
    tmp_path: Path, encoding: str, code: int
) -> None:
    """A categorical column with a code that names no category (2 of 2 names): refused at
    open, naming file, top and row, in a later file too; -1 (missing) is a code."""
    good, bad = tmp_path / "good.h5", tmp_path / "bad.h5"
    for path, codes in ((good, [0, 1, -1, 1]), (bad, [1, 0, 1, 0, 0, code, 1])):
        with h5py.File(path, "w") as f:
            names = np.array([b"a", b"b"])
            if encoding == "group":
                g = f.create_group("obs/kind")
                g.attrs["encoding-type"] = "categorical"
                g["codes"], g["categories"] = np.array(codes, np.int8), names
            else:
                ref = f.create_dataset("obs/__categories/kind", data=names).ref
                f.create_dataset("obs/kind", data=np.array(codes, np.int8)).attrs["categories"] = (
                    ref
                )
    with HDF5DataLayer(good, tops=("obs/kind",), batch_size=2) as layer:
        assert [c for b in layer for c in b["obs/kind"].tolist()] == [0, 1, -1, 1]
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer([good, bad], tops=("obs/kind",), batch_size=2).__enter__()
    check_message(err.value, "bad.h5", "'obs/kind'", f"code {code} at row 5", "2 categories")


def _tamper(path: Path, kind: str) -> None:
    """Break ``tok`` or ``X`` of ``path`` (a file of 12 rows of 3 values) the way ``kind`` says."""
    with h5py.File(path, "a") as f:
        top = f["X"] if kind.startswith("X ") else f["tok"]
        ip = top["indptr"][()]
        if kind == "decreasing":
            ip[6] = ip[5] - 1
        elif kind == "past data":
            ip[-1] += 2
        elif kind == "short of data":
            ip[-1] -= 1
            ip[-2] -= 1
        elif kind == "from 1":
            ip += 1
        elif kind == "X data and indices":
            del top["indices"]
            top["indices"] = np.zeros(len(top["data"]) - 1, np.int32)
            return
        elif kind == "X no shape":
            del top.attrs["shape"]
            return
        elif kind == "X shape of 3":
            top.attrs["shape"] = (12, COLS, 1)
            return
        elif kind == "X shape of rows":
            top.attrs["shape"] = (13, COLS)
            return
        del top["indptr"]
        top["indptr"] = ip


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("decreasing", "'indptr' decreases at row 5"),
        ("past data", "'indptr' ends at 38, but 'data' holds 36 values"),
        ("short of data", "'indptr' ends at 35, but 'data' holds 36 values"),
        ("from 1", "'indptr' starts at 1, not 0"),
        ("X data and indices", "'indices' must be a 1-D integer dataset as long as 'data'"),
        ("X no shape", "no 'shape' attribute"),
        ("X shape of 3", "its 'shape' attribute is (12, 6, 1), not two integers"),
        ("X shape of rows", "its 'shape' says 13 rows, 'indptr' has 12"),
    ],
)
def test_a_later_file_tampered_with_is_a_named_error_at_open(
    tmp_path: Path, kind: str, words: str
) -> None:
    """The third of three files broken mid-way: refused at open, naming it and the top, so no
    batch of the first two is served before the epoch meets it."""
    files = write_all(tmp_path, [np.full(12, 3, np.int64)] * 3)
    _tamper(files[2], kind)
    layer = HDF5DataLayer(files, tops=TOPS, batch_size=4, shuffle=True)
    with pytest.raises(SchemaError) as err:
        layer.__enter__()
    top = "'X'" if kind.startswith("X ") else "'tok'"
    check_message(err.value, "f2.h5", f"top {top}", words)


# --- files the anndata package wrote ------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_anndata_csr_categorical_and_compressed(tmp_path: Path, compression: str | None) -> None:
    """An .h5ad file as anndata writes it (gzipped too, in its own stored chunks): the sparse
    X, a categorical obs column with a missing value and a number column, each row its cell,
    each cell once an epoch."""
    anndata = pytest.importorskip("anndata")
    import pandas as pd

    n = 90
    m = scipy.sparse.random(n, 7, density=0.3, format="csr", random_state=4, dtype=np.float32)
    kinds = pd.Categorical(["b", "a", None, "c", "a", "b"] * 15)
    obs = pd.DataFrame({"kind": kinds, "i": np.arange(n)}, index=[f"c{i}" for i in range(n)])
    path = tmp_path / "cells.h5ad"
    anndata.AnnData(X=m, obs=obs).write_h5ad(path, compression=compression)
    dense, codes = m.toarray(), kinds.codes
    tops = ("X", "obs/kind", "obs/i")
    with HDF5DataLayer(path, tops=tops, batch_size=8, shuffle=True, chunk_size=20) as layer:
        assert layer.categories["obs/kind"] == ("a", "b", "c")
        paths = {"sparse-chunks"} if compression else {"sparse-mmap", "sparse-pread"}
        assert layer.stats.read_paths["X"] in paths
        for _ in range(2):
            seen = []
            for b in layer:
                np.testing.assert_array_equal(b["obs/i"], b.indices)
                np.testing.assert_array_equal(b["X"].toarray(), dense[b.indices])
                np.testing.assert_array_equal(b["obs/kind"], codes[b.indices])
                seen += b.indices.tolist()
            check_exactly_once([seen], n)


def test_anndata_csc_x_and_layers_are_refused_with_the_route(tmp_path: Path) -> None:
    """A CSC X (common: many tools write one) and a CSC layer, as anndata writes them: a
    SchemaError at open naming the top and the ways to CSR, never rows read as columns."""
    anndata = pytest.importorskip("anndata")
    m = scipy.sparse.random(20, 5, density=0.4, format="csc", random_state=1, dtype=np.float32)
    path = tmp_path / "csc.h5ad"
    anndata.AnnData(X=m, layers={"counts": m.copy()}).write_h5ad(path)
    for top, held in (("X", "adata.X"), ("layers/counts", "adata.layers['counts']")):
        with pytest.raises(SchemaError) as err:
            HDF5DataLayer(path, tops=(top,), batch_size=4).__enter__()
        check_message(err.value, "csc.h5ad", repr(top), "CSC", "asynchdf5 pack")
        check_message(err.value, f"`{held} = {held}.tocsr()`")


@pytest.mark.parametrize("top", ["tok", "X", "vlen"])
def test_a_row_larger_than_the_budget_is_a_named_error_at_open(tmp_path: Path, top: str) -> None:
    """docs/sequences.md: a row longer than a batch's share of ``cache_bytes`` is a
    ConfigurationError at open naming the budget, for a sparse row and a variable-length one
    as for a ragged one (tests/test_ragged.py), never an overflowed slot."""
    lens = np.full(10, 2, np.int64)
    lens[3] = 40_000
    path = write_both(tmp_path / "big.h5", 0, lens, x_lens=lens, cols=40_000)
    if top == "vlen":
        with h5py.File(path, "a") as f:
            d = f.create_dataset("vlen", (10,), dtype=h5py.vlen_dtype(np.int64))
            for i, n in enumerate(lens):
                d[i] = np.full(n, i)
    layer = HDF5DataLayer(path, tops=(top, "label"), batch_size=2, cache_bytes=150_000)
    with pytest.raises(ConfigurationError) as err:
        layer.__enter__()
    check_message(err.value, "cache_bytes=150000", "longest rows")


@pytest.mark.parametrize("top", ["tok", "X"])
def test_a_file_rewritten_mid_epoch_is_a_read_error_not_a_batch(tmp_path: Path, top: str) -> None:
    """The second file's bytes rewritten in place (size and mtime kept) after the first batch,
    before its rows are read: the epoch ends with a ReadError naming it, and every batch served
    before holds its own rows."""
    files = write_all(tmp_path, [lengths_of(0, 40, 30), lengths_of(40, 40, 30)])
    layer = HDF5DataLayer(
        files, tops=(top, "dense", "label", "len"), batch_size=4, chunk_size=8, mmap=False
    )
    served = 0
    with layer, pytest.raises(ReadError) as err:
        for b in layer:
            if top == "tok":
                check_rows(b)
            else:
                np.testing.assert_array_equal(b["X"].toarray(), b["dense"])
            np.testing.assert_array_equal(b["label"], b.indices)
            served += 1
            if served == 1:
                rewrite_in_place(files[1])
    assert served < 20  # none of the second file's
    check_message(err.value, "f1.h5", "top '")


@settings(
    max_examples=examples(6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    sizes=st.lists(st.integers(0, 25), min_size=1, max_size=3).filter(lambda s: sum(s) >= 12),
    old=st.integers(1, 3),
    new=st.integers(1, 4),
    stop=st.integers(0, 3),
    batch_size=st.integers(1, 4),
    huge=st.sampled_from([0, 3_000]),
)
def test_property_elastic_resume_of_ragged_and_sparse_tops(
    tmp_path_factory: pytest.TempPathFactory,
    sizes: list[int],
    old: int,
    new: int,
    stop: int,
    batch_size: int,
    huge: int,
) -> None:
    """Files of rows of every length (one huge, maybe), all ranks of an ``old``-rank run
    stopped after ``stop`` batches, the rest of the epoch on ``new`` ranks: every sample
    exactly once over both, equal batch counts on the new ranks, every row its own."""
    n = sum(sizes)
    lens = lengths_of(0, n, longest=9)
    lens[n // 2] += huge
    cuts = np.cumsum([0, *sizes])
    files = write_all(
        tmp_path_factory.mktemp("el"), [lens[a:b] for a, b in itertools.pairwise(cuts)]
    )
    kw: dict[str, Any] = {"tops": TOPS, "batch_size": batch_size, "shuffle": True, "seed": 3}
    kw["chunk_size"] = batch_size + 5
    before, states = [], []
    for rank in range(old):
        layer = HDF5DataLayer(files, rank=rank, world_size=old, **kw)
        try:
            layer.__enter__()
        except ConfigurationError as exc:  # the old run itself cannot split the epoch
            assert "cannot be split" in str(exc) and rank == 0
            return
        try:
            it = iter(layer)
            before += [i for _ in range(min(stop, len(layer))) for i in check_both(next(it))]
            states.append(layer.state_dict())
        finally:
            layer.__exit__(None, None, None)
    after: list[int] = []
    counts: list[int] = []
    for rank in range(new):
        resumed = HDF5DataLayer(files, rank=rank, world_size=new, **kw)
        resumed.load_state_dict(states[-1])
        try:
            with resumed:
                batches = [check_both(b) for b in resumed]
        except ConfigurationError as exc:  # too few samples left for equal counts: all refuse
            assert "cannot be split" in str(exc) or "fewer than world_size" in str(exc)
            assert rank == 0 or not counts
            return
        counts.append(len(batches))
        after += [i for b in batches for i in b]
    assert len(set(counts)) == 1, counts
    check_exactly_once([before, after], n)


@pytest.mark.parametrize("ragged", ["padded", "nested"])
def test_torch_batches_of_empty_rows_only(tmp_path: Path, ragged: str) -> None:
    """The torch adapter over a file whose rows are all empty: a (rows, 0) padded tensor with
    zero lengths, or a jagged tensor of empty rows; a sparse CSR tensor of no non-zeros."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    files = write_all(tmp_path, [np.zeros(6, np.int64)])
    rows = []
    with HDF5IterableDataset(files, tops=TOPS, batch_size=4, ragged=ragged) as ds:
        for b in DataLoader(ds, batch_size=None):
            n = len(b["label"])
            if ragged == "padded":
                padded, lengths = b["tok"]
                assert padded.shape == (n, 0) and lengths.tolist() == [0] * n
            else:
                assert b["tok"].is_nested and [len(r) for r in b["tok"].unbind()] == [0] * n
            assert b["X"].layout == torch.sparse_csr and b["X"].shape == (n, COLS)
            assert torch.equal(b["X"].to_dense(), b["dense"]) and not b["dense"].any()
            rows += b["label"].tolist()
    assert rows == list(range(6))


@pytest.mark.parametrize(
    ("member", "words"), [("tok/data", "'tok', its 'data'"), ("X/indices", "'X', its 'indices'")]
)
def test_a_corrupt_stored_chunk_of_values_is_a_read_error_naming_the_member(
    tmp_path: Path, member: str, words: str
) -> None:
    """A stored chunk of a ragged top's values (or a sparse top's column indices) that fails
    its Fletcher-32 checksum: the epoch ends with a ReadError naming the file, the top and the
    member whose rows (values, not samples) the chunk holds; every batch before is right."""
    path = write_both(tmp_path / "f.h5", 0, lengths_of(0, 40, 30), fletcher32=True, chunks=(16,))
    with h5py.File(path) as f:
        info = f[member].id.get_chunk_info(3)
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset + 5)
        raw.write(b"\xff\xff")
    layer = HDF5DataLayer(path, tops=TOPS, batch_size=4, chunk_size=8)
    with layer, pytest.raises(ReadError) as err:
        for b in layer:
            check_both(b)
    assert layer.stats.read_paths["X"] == "sparse-chunks"
    check_message(err.value, "f.h5", f"top {words}, rows 48:", "stored chunk 3", "checksum")


def test_a_shape_of_whole_floats_is_read_and_of_text_is_refused(tmp_path: Path) -> None:
    """A ``shape`` written as floats (some writers do) names its columns as integers would;
    one written as text is refused as not two integers, not as missing."""
    path = write_both(tmp_path / "f.h5", 0, lengths_of(0, 10))
    with h5py.File(path, "a") as f:
        f["X"].attrs["shape"] = np.array([10.0, COLS])
    with HDF5DataLayer(path, tops=TOPS, batch_size=4) as layer:
        check_exactly_once([[i for b in layer for i in check_both(b)]], 10)
    with h5py.File(path, "a") as f:
        f["X"].attrs["shape"] = "(10, 6)"
    with pytest.raises(SchemaError) as err:
        HDF5DataLayer(path, tops=TOPS, batch_size=4).__enter__()
    check_message(err.value, "f.h5", "top 'X'", "its 'shape' attribute is ('(10, 6)',)")


def test_a_stream_of_ragged_and_sparse_tops_resumes_exactly(tmp_path: Path) -> None:
    """`stream()` stopped past an epoch's end and saved: a new layer loaded from the state goes
    on with exactly the batches the first would have given, rows checked."""
    files = write_all(tmp_path, [lengths_of(0, 13), lengths_of(13, 8)])
    kw: dict[str, Any] = {"tops": TOPS, "batch_size": 4, "shuffle": True, "seed": 5}
    kw["chunk_size"] = 6
    with HDF5DataLayer(files, **kw) as layer:
        whole = [check_both(b) for b in itertools.islice(layer.stream(), 12)]
    with HDF5DataLayer(files, **kw) as layer:
        stream = iter(layer.stream())
        head = [check_both(next(stream)) for _ in range(7)]  # 28 rows: past the first epoch
        state = layer.state_dict()
    resumed = HDF5DataLayer(files, **kw)
    resumed.load_state_dict(state)
    with resumed:
        tail = [check_both(b) for b in itertools.islice(resumed.stream(), 5)]
    assert head + tail == whole


def test_exact_resume_mid_epoch_of_sparse_and_vlen_tops(tmp_path: Path) -> None:
    """A state saved mid-epoch over ragged, sparse and variable-length tops: the resumed layer
    serves exactly the batches the first would have, and a third run with the same seed serves
    the same epoch again."""
    files = write_all(tmp_path, [lengths_of(0, 19), lengths_of(19, 14)], vlen=True)
    kw: dict[str, Any] = {"tops": (*TOPS, "vl"), "batch_size": 4, "shuffle": True, "seed": 9}
    kw["chunk_size"] = 7
    with HDF5DataLayer(files, **kw) as layer:
        assert layer.stats.read_paths["vl"] == "vlen-h5py"
        whole = [check_both(b) for b in layer]
    with HDF5DataLayer(files, **kw) as layer:
        it = iter(layer)
        head = [check_both(next(it)) for _ in range(5)]
        state = layer.state_dict()
    resumed = HDF5DataLayer(files, **kw)
    resumed.load_state_dict(state)
    with resumed:
        tail = [check_both(b) for b in resumed]
    assert head + tail == whole
    check_exactly_once([[i for b in whole for i in b]], 33)


@pytest.mark.parametrize("kind", ["Ragged", "csr_matrix", "list"])
def test_memory_layer_refuses_rows_of_varying_length_by_name(kind: str) -> None:
    """MemoryDataLayer serves arrays of fixed rows: a Ragged, a sparse matrix or rows of
    unequal lengths are a SchemaError naming the top and the ways that work (it was NumPy's
    ValueError about an inhomogeneous shape, or "a 0-d array" for a sparse matrix)."""
    value = {
        "Ragged": Ragged(np.arange(6), np.array([0, 2, 6])),
        "csr_matrix": scipy.sparse.csr_matrix(np.eye(2)),
        "list": [[1, 2], [3]],
    }[kind]
    with pytest.raises(SchemaError) as err:
        MemoryDataLayer({"tok": value, "label": np.arange(2)}, batch_size=1)
    check_message(err.value, "data['tok']", "varying length", kind, "HDF5DataLayer")


def test_column_check_of_narrow_indices_under_very_many_columns() -> None:
    """int8 column indices under 1,000 columns: a negative index, which seen unsigned is
    below the columns, is still found; indices in range pass."""
    info = RaggedInfo("sparse", 1_000, np.dtype(np.int8), files=("f.h5",))
    info = dataclasses.replace(info, lengths=RowLengths([(3, np.array([0, 1, 2, 3]))]))
    offsets = np.array([0, 1, 2, 3])
    info.check_columns("X", np.array([5, 100, 127], np.int8), offsets, np.arange(3))
    with pytest.raises(ReadError) as err:
        info.check_columns("X", np.array([5, -3, 1], np.int8), offsets, np.arange(3))
    check_message(err.value, "f.h5: top 'X', row 1 ", "column index -3", "1000 columns")
