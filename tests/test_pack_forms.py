"""``asynchdf5 pack`` and ``inspect`` for samples that are not fixed rows (issue 41, item 3):
Parquet list columns become ragged groups (``data`` + ``indptr``), string columns categorical
groups, an ``.h5ad`` file is rewritten with contiguous layouts (sparse X kept as CSR, CSC made
CSR, categoricals kept) that AnnData still reads; ``inspect`` says each top's form.

The ragged groups are checked here with h5py; reading them with the layer needs
``asynchdf5.Ragged`` (built beside this), and that test skips until it exists."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import asynchdf5
from asynchdf5 import HDF5DataLayer, Windows

from ._helpers import peak_growth, run_main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """anndata and scipy may warn about their own futures: not these tests' business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _table(path: Path, n: int = 50) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, n)
    lengths[3] = 0  # an empty row
    tokens = [np.arange(k, dtype=np.int32) + 100 * i for i, k in enumerate(lengths)]
    atoms = [rng.random((k % 4 + 1, 3)).astype(np.float32) for k in lengths]
    kinds = [("cat", "dog", "emu")[i % 3] for i in range(n)]
    pa_atoms = pa.array(
        [[list(map(float, r)) for r in a] for a in atoms],
        type=pa.list_(pa.list_(pa.float32(), 3)),
    )
    table = pa.table(
        {
            "tokens": pa.array([t.tolist() for t in tokens], type=pa.list_(pa.int32())),
            "atoms": pa_atoms,
            "row": pa.array(np.arange(n, dtype=np.int64)),
            "kind": pa.array(kinds),
        }
    )
    pq.write_table(table, path)
    return {"tokens": tokens, "atoms": atoms, "kind": kinds}


def _ragged_rows(g: h5py.Group) -> list[np.ndarray]:
    data, indptr = g["data"][()], g["indptr"][()]
    assert indptr.dtype == np.int64 and indptr[0] == 0 and indptr[-1] == len(data)
    assert (np.diff(indptr) >= 0).all()
    assert g["data"].chunks is None  # contiguous: the direct-read path
    return [data[indptr[r] : indptr[r + 1]] for r in range(len(indptr) - 1)]


@pytest.mark.timeout(60)
def test_pack_writes_ragged_groups_from_parquet_list_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = _table(tmp_path / "t.parquet")
    out = tmp_path / "out"
    args = ["pack", tmp_path / "t.parquet", out, "--shuffle", "--samples-per-file", "20"]
    status, text, err = run_main([*args, "--columns", "tokens", "atoms", "row", "kind"], capsys)
    assert status == 0, err
    files = (out / "train.txt").read_text().split()
    assert files == ["train-00000.h5", "train-00001.h5", "train-00002.h5"]
    seen = []
    names = None
    for name in files:
        with h5py.File(out / name) as f:
            assert f.attrs["shuffled"]
            rows = f["row"][()]
            seen += rows.tolist()
            for r, tok in zip(rows, _ragged_rows(f["tokens"]), strict=True):
                np.testing.assert_array_equal(tok, truth["tokens"][r])
            for r, at in zip(rows, _ragged_rows(f["atoms"]), strict=True):
                assert at.shape[1:] == (3,)  # a trailing shape
                np.testing.assert_array_equal(at, truth["atoms"][r])
            g = f["kind"]
            assert g.attrs["encoding-type"] == "categorical"
            here = tuple(s.decode() for s in g["categories"][()])
            assert names is None or here == names  # the same categories in every file
            names = here
            for r, c in zip(rows, g["codes"][()], strict=True):
                assert names[c] == truth["kind"][r]
    assert sorted(seen) == list(range(50))
    assert seen != list(range(50))  # shuffled
    # What inspect makes of it: the forms, read as the layer would.
    status, text, _ = run_main(["inspect", out / "train.txt", "--tops", "tokens", "kind"], capsys)
    assert "tokens: ragged: variable-length rows (data + indptr" in text
    assert "kind: categorical: 3 categories ('cat', 'dog', 'emu')" in text


@pytest.mark.timeout(60)
def test_the_layer_reads_packed_ragged_tops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not hasattr(asynchdf5, "Ragged"):
        pytest.skip("asynchdf5.Ragged (ragged tops) is not in this build yet")
    truth = _table(tmp_path / "t.parquet")
    out = tmp_path / "out"
    args = ["pack", tmp_path / "t.parquet", out, "--shuffle", "--columns", "tokens", "row", "kind"]
    assert run_main(args, capsys)[0] == 0
    with HDF5DataLayer(
        out / "train.txt", tops=("tokens", "row", "kind"), batch_size=8, shuffle=True
    ) as layer:
        assert layer.categories["kind"] == ("cat", "dog", "emu")
        seen = []
        for batch in layer:
            r = batch["tokens"]
            for i, row in enumerate(np.array(batch["row"])):
                np.testing.assert_array_equal(np.asarray(r[i]), truth["tokens"][row])
                seen.append(int(row))
    assert sorted(seen) == list(range(50))


def _token_table(path: Path, rows: int, width: int) -> None:
    """``rows`` rows of ``width`` int32 tokens (row ``i`` all ``i``) and a label, in row groups
    of 256 rows."""
    tokens = pa.FixedSizeListArray.from_arrays(
        pa.array(np.repeat(np.arange(rows, dtype=np.int32), width)), width
    ).cast(pa.list_(pa.int32()))
    table = pa.table({"tok": tokens, "label": pa.array(np.arange(rows, dtype=np.int64))})
    pq.write_table(table, path, row_group_size=256)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_pack_of_a_parquet_list_column_runs_in_bounded_memory(tmp_path: Path) -> None:
    """Packing 64 MiB of token lists (shuffled) takes no more memory than packing 16 MiB, but
    for a few MiB: each row group's column is staged and each output file gathered a block at
    a time. Read whole, the table, its numpy copies and the shuffled take grew it by ~3 times
    the data."""
    width, grew = 4096, {}
    for rows in (1024, 4096):
        path, out = tmp_path / f"t{rows}.parquet", tmp_path / f"out{rows}"
        _token_table(path, rows, width)
        grew[rows] = peak_growth(
            "import sys\nfrom asynchdf5._cli import main",
            "status = main(['pack', sys.argv[1], sys.argv[2], '--shuffle'])\n"
            "assert status == 0, status",
            [path, out],
            timeout=100,
        )
        assert not [p for p in out.iterdir() if p.name.startswith(".pack-")]  # no scratch left
    assert grew[4096] - grew[1024] < 16 << 20, {k: v >> 20 for k, v in grew.items()}
    with h5py.File(tmp_path / "out4096" / "train-00000.h5") as f:
        labels, indptr = f["label"][()], f["tok/indptr"][()]
        assert sorted(labels.tolist()) == list(range(4096)) and labels.tolist() != sorted(labels)
        np.testing.assert_array_equal(indptr, np.arange(4096 + 1) * width)
        for r in (0, 1, 2048, 4095):
            np.testing.assert_array_equal(f["tok/data"][indptr[r] : indptr[r + 1]], labels[r])


def test_pack_refuses_what_it_cannot_keep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(pa.table({"x": pa.array([[[1, 2], [3]], [[4]]])}), tmp_path / "n.parquet")
    status, _, err = run_main(["pack", tmp_path / "n.parquet", tmp_path / "o"], capsys)
    assert status == 1 and "lists of lists of varying length" in err
    pq.write_table(pa.table({"x": pa.array([[1], None])}), tmp_path / "m.parquet")
    status, _, err = run_main(["pack", tmp_path / "m.parquet", tmp_path / "o2"], capsys)
    assert status == 1 and "missing values" in err


def _anndata(path: Path, fmt: str) -> Any:
    ad = pytest.importorskip("anndata")
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(1)
    n, genes = 40, 9
    x = sparse.random(n, genes, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical([("T", "B", "NK")[i % 3] for i in range(n)]),
            "row": np.arange(n),
        },
        index=[f"c{i}" for i in range(n)],
    )
    a = ad.AnnData(X=x.tocsc() if fmt == "csc" else x.toarray() if fmt == "dense" else x, obs=obs)
    with _quiet():
        a.write_h5ad(path, compression="gzip")  # chunked, filtered: what pack undoes
    return a


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["csr", "csc", "dense"])
def test_pack_rewrites_an_h5ad_in_fast_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    ad = pytest.importorskip("anndata")
    original = _anndata(tmp_path / "a.h5ad", fmt)
    out = tmp_path / "out"
    status, _, err = run_main(["pack", tmp_path / "a.h5ad", out], capsys)
    assert status == 0, err
    assert (out / "train.txt").read_text().split() == ["train-00000.h5"]
    packed = out / "train-00000.h5"
    with h5py.File(packed) as f:
        if fmt == "dense":
            assert f["X"].chunks is None and f["X"].compression is None
        else:
            assert f["X"].attrs["encoding-type"] == "csr_matrix"
            for k in ("data", "indices", "indptr"):
                assert f["X"][k].chunks is None  # contiguous: one range per chunk of rows
        assert f["obs/cell_type"].attrs["encoding-type"] == "categorical"
        assert f["obs/cell_type/codes"].chunks is None
    with _quiet():
        back = ad.read_h5ad(packed)
    x0 = original.X.toarray() if hasattr(original.X, "toarray") else original.X
    x1 = back.X.toarray() if hasattr(back.X, "toarray") else back.X
    np.testing.assert_array_equal(x0, x1)
    assert list(back.obs["cell_type"]) == list(original.obs["cell_type"])
    # The layer reads its categorical and numeric obs columns (and a dense X) now.
    tops = ("obs/cell_type", "obs/row") + (("X",) if fmt == "dense" else ())
    with HDF5DataLayer(out / "train.txt", tops=tops, batch_size=16, shuffle=True) as layer:
        names = layer.categories["obs/cell_type"]
        for batch in layer:  # (bounded by the test's timeout)
            rows = np.array(batch["obs/row"])
            codes = np.array(batch["obs/cell_type"])
            want = [original.obs["cell_type"].iloc[r] for r in rows]
            assert [names[c] for c in codes] == want
            if fmt == "dense":
                np.testing.assert_array_equal(np.array(batch["X"]), x0[rows])
    status, text, _ = run_main(["inspect", out / "train.txt", "--tops", "X"], capsys)
    if fmt != "dense":
        assert "X: sparse csr: a sparse matrix of shape (40, 9) (csr_matrix" in text
    status, _, err = run_main(["pack", tmp_path / "a.h5ad", tmp_path / "o", "--shuffle"], capsys)
    assert status == 1 and "--shuffle does not apply to .h5ad inputs" in err


def test_inspect_windows_and_variable_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "f.h5"
    with h5py.File(p, "w") as f:
        f["tokens"] = np.arange(5000, dtype=np.uint16)
        vl = f.create_dataset("vl", (3,), dtype=h5py.vlen_dtype(np.int32))
        vl[0], vl[1], vl[2] = [1, 2], [3], []
    status, text, _ = run_main(["inspect", p, "--windows", "tokens:1025:1024"], capsys)
    assert status == 0
    assert "tokens: windows: windows of 1025 elements every 1024" in text
    status, text, _ = run_main(["inspect", p, "--tops", "tokens", "vl"], capsys)
    assert "tokens: rows: a 1-D stream of integers: Windows(top, length, stride)" in text
    # Beside a top of as many rows (an image's label, an AnnData obs column) it is a column of
    # the samples, not a stream: no Windows note there.
    with h5py.File(p, "a") as f:
        f["data"] = np.zeros((5000, 2), np.float32)
    status, beside, _ = run_main(["inspect", p, "--tops", "data", "tokens"], capsys)
    assert status == 0 and "  tokens: rows\n" in beside and "1-D stream" not in beside, beside
    assert "vl: variable-length: an h5py variable-length dataset" in text
    assert "vl: h5py fallback (h5py)" in text
    status, _, err = run_main(["inspect", p, "--windows", "tokens:x"], capsys)
    assert status == 2 and "TOP:LENGTH" in err
    # The catalog's verdict on windows: samples as the layer counts them.
    with HDF5DataLayer(p, tops=(Windows("tokens", 1025, 1024),), batch_size=2) as layer:
        assert layer.n_samples == 4


@pytest.mark.timeout(60)
def test_inspect_counts_a_variable_length_tops_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bytes of an h5py variable-length top are its values' (not 0), and its stored bytes,
    which h5py gives only for the rows' references (the values lie in HDF5's heap), none."""
    p = tmp_path / "f.h5"
    with h5py.File(p, "w") as f:
        vl = f.create_dataset("vl", (3,), dtype=h5py.vlen_dtype(np.int32))
        vl[0], vl[1], vl[2] = np.arange(1000), [3], []
    status, text, err = run_main(["inspect", p, "--json", "--tops", "vl"], capsys)
    assert status == 0, err
    (top,) = json.loads(text)["files"][0]["tops"]
    assert top["bytes"] == 1001 * 4 and top["stored_bytes"] is None


def test_pack_turns_variable_length_datasets_into_ragged_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(3)
    truth: list[np.ndarray] = []
    paths = []
    for k, n in enumerate((30, 0, 25)):
        p = tmp_path / f"v{k}.h5"
        with h5py.File(p, "w") as f:
            d = f.create_dataset("tokens", (n,), dtype=h5py.vlen_dtype(np.int32))
            for i in range(n):
                row = rng.integers(0, 1000, rng.integers(0, 6)).astype(np.int32)
                d[i] = row
                truth.append(row)
            f["label"] = np.arange(len(truth) - n, len(truth), dtype=np.int64)
            f["emb"] = np.repeat(f["label"][()][:, None], 4, axis=1).astype(np.float32)
        paths.append(p)
    out = tmp_path / "out"
    args = ["pack", *paths, out, "--tops", "tokens", "label", "emb", "--shuffle"]
    status, _, err = run_main(args, capsys)
    assert status == 0, err
    seen = []
    for name in (out / "train.txt").read_text().split():
        with h5py.File(out / name) as f:
            labels = f["label"][()]
            np.testing.assert_array_equal(f["emb"][()], np.repeat(labels[:, None], 4, axis=1))
            for r, row in zip(labels, _ragged_rows(f["tokens"]), strict=True):
                np.testing.assert_array_equal(row, truth[r])
                assert row.dtype == np.int32
            seen += labels.tolist()
    assert sorted(seen) == list(range(55))
    # A file without variable-length tops still packs them as rows, as before.
    status, _, err = run_main(["pack", paths[0], tmp_path / "rows", "--tops", "label"], capsys)
    assert status == 0, err
    with h5py.File(tmp_path / "rows" / "train-00000.h5") as f:
        assert f["label"].shape == (30,)


def test_packing_variable_length_datasets_needs_no_pyarrow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without pyarrow (no `pack` extra), an HDF5 file's variable-length tops still pack:
    they are streamed from h5py into ragged groups, with no table in between."""
    p = tmp_path / "v.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("tokens", (2,), dtype=h5py.vlen_dtype(np.int32))
        d[0], d[1] = np.arange(3, dtype=np.int32), np.arange(1, dtype=np.int32)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    status, _, err = run_main(["pack", p, tmp_path / "out", "--tops", "tokens"], capsys)
    assert status == 0, err
    with h5py.File(tmp_path / "out" / "train-00000.h5") as f:
        assert f["tokens/data"][()].tolist() == [0, 1, 2, 0]
        assert f["tokens/indptr"][()].tolist() == [0, 3, 4]


@pytest.mark.parametrize("tops", [("tok", "label"), ("vl", "tok"), ("X", "label"), ("c", "label")])
def test_pack_names_a_group_top_by_its_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tops: tuple[str, ...]
) -> None:
    """A ragged, sparse or categorical group in --tops is refused by its form (the layer reads
    it as it is), not as "a Group, not a dataset" or "no dataset", beside rows or vlen tops."""
    p = tmp_path / "g.h5"
    with h5py.File(p, "w") as f:
        f["label"] = np.arange(2)
        vl = f.create_dataset("vl", (2,), dtype=h5py.vlen_dtype(np.int32))
        vl[0], vl[1] = np.arange(2, dtype=np.int32), np.arange(1, dtype=np.int32)
        t = f.create_group("tok")
        t["data"], t["indptr"] = np.arange(3), np.array([0, 1, 3])
        x = f.create_group("X")
        x.attrs["shape"] = (2, 3)
        x["data"], x["indices"], x["indptr"] = np.ones(2), np.array([0, 2]), np.array([0, 1, 2])
        c = f.create_group("c")
        c["codes"], c["categories"] = np.array([0, 1], np.int8), np.array([b"a", b"b"])
    status, _, err = run_main(["pack", p, tmp_path / "out", "--tops", *tops], capsys)
    group = next(t for t in tops if t in ("tok", "X", "c"))
    words = {"tok": "a ragged group", "X": "a sparse CSR group", "c": "a categorical group"}
    assert status == 1
    assert f"top {group!r} is {words[group]}, which the layer reads as it is" in err, err
    assert "leave it out of --tops" in err
