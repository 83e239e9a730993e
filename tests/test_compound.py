"""Datasets in groups and compound datasets (issue 39, items 2 and 3): the fields of a compound
dataset are tops (pandas' ``to_hdf(format="table")``, or h5py's own), ``pack`` converts them,
and a top that is missing is answered with every dataset of the file, in groups too."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer, SchemaError

from ._files import check_message
from ._helpers import run_main

N = 120
RECORD = np.dtype([("index", "<i8"), ("values", "<f8", (3,)), ("code", "<i4"), ("name", "S4")])


def _compound_file(path: Path, chunks: tuple[int, ...] | None = None) -> Path:
    """An h5py compound dataset ``g/table`` whose fields all derive from the row number."""
    rec = np.zeros(N, RECORD)
    rec["index"] = np.arange(N)
    rec["values"] = np.arange(N)[:, None] * 10 + np.arange(3)
    rec["code"] = np.arange(N) % 7
    rec["name"] = [b"r%d" % i for i in range(N)]
    with h5py.File(path, "w") as f:
        f.create_dataset("g/table", data=rec, chunks=chunks)
    return path


def _epoch(source: Path, tops: tuple[str, ...], process: bool = False) -> dict[str, np.ndarray]:
    got: dict[str, list[np.ndarray]] = {t: [] for t in tops}
    with HDF5DataLayer(
        source, tops=tops, batch_size=16, shuffle=True, seed=4, process=process
    ) as layer:
        for batch in layer:
            for t in tops:
                got[t].append(np.array(batch[t]))
    return {t: np.concatenate(v) for t, v in got.items()}


def _open(source: Path, tops: tuple[str, ...]) -> None:
    with HDF5DataLayer(source, tops=tops, batch_size=4):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("chunks", "process"), [(None, False), ((7,), False), ((7,), True)])
def test_the_fields_of_an_h5py_compound_dataset_are_tops(
    tmp_path: Path, chunks: tuple[int, ...] | None, process: bool
) -> None:
    source = _compound_file(tmp_path / "c.h5", chunks)
    got = _epoch(source, ("g/table/index", "g/table/values", "g/table/code"), process)
    idx = got["g/table/index"]
    assert sorted(idx.tolist()) == list(range(N))  # every sample once
    assert got["g/table/values"].shape == (N, 3) and got["g/table/values"].dtype == np.float64
    np.testing.assert_array_equal(got["g/table/values"], idx[:, None] * 10 + np.arange(3))
    np.testing.assert_array_equal(got["g/table/code"], idx % 7)  # rows of the same samples


def test_a_compound_dataset_or_a_string_field_says_what_works(tmp_path: Path) -> None:
    source = _compound_file(tmp_path / "c.h5")
    with pytest.raises(SchemaError, match=r"name its fields as tops: 'g/table/index'"):
        _open(source, tops=("g/table",))
    with pytest.raises(SchemaError, match=r"'g/table/name' holds strings.*integer codes"):
        _open(source, tops=("g/table/name",))
    with pytest.raises(SchemaError, match=r"'/g/table \(fields index, values, code, name\)'"):
        _open(source, tops=("g/table/nope",))


@pytest.mark.timeout(60)
def test_a_pandas_table_is_read_and_packed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("tables")
    n = 200
    df = pd.DataFrame(np.arange(n * 4, dtype=np.float64).reshape(n, 4), columns=list("abcd"))
    df["label"] = np.arange(n, dtype=np.int64) % 5
    df["note"] = [f"n{i}" for i in range(n)]
    path = tmp_path / "frame.h5"
    df.to_hdf(path, key="t", format="table")
    tops = ("t/table/index", "t/table/values_block_0", "t/table/values_block_1")
    got = _epoch(path, tops)
    i = got["t/table/index"]
    assert sorted(i.tolist()) == list(range(n))
    np.testing.assert_array_equal(got["t/table/values_block_0"], df.to_numpy()[i, :4])
    np.testing.assert_array_equal(got["t/table/values_block_1"][:, 0], i % 5)
    with pytest.raises(SchemaError, match="values_block_2' holds strings"):
        _open(path, tops=("t/table/values_block_2",))

    status, text, err = run_main(["inspect", path, "--json", "--tops", *tops], capsys)
    assert status == 0, err  # inspect reads the fields as the layer does
    assert json.loads(text)["read_paths"] == dict.fromkeys(tops, "h5py")

    out = tmp_path / "packed"
    status, _, err = run_main(["pack", path, out, "--tops", *tops], capsys)
    assert status == 0, err
    got = _epoch(out / "train.txt", tops)
    i = got["t/table/index"]
    assert sorted(i.tolist()) == list(range(n))
    np.testing.assert_array_equal(got["t/table/values_block_0"], df.to_numpy()[i, :4])


def test_pack_names_the_datasets_that_sit_in_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # AnnData and pandas keep their datasets in groups: the root alone has none.
    path = tmp_path / "grouped.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("obsm/X_pca", data=np.zeros((10, 2)))
        f.create_dataset("layers/counts", data=np.zeros((10, 3)))
    status, _, err = run_main(["pack", path, tmp_path / "out", "--tops", "data"], capsys)
    assert status == 1
    assert "'/layers/counts'" in err and "'/obsm/X_pca'" in err, err
    assert "--tops" in err


def _pandas_table(path: Path, n: int, **to_hdf: object) -> Path:
    """A pandas table as ``to_hdf(format="table")`` writes it: the data in ``t/table`` and,
    beside it, PyTables' index of the index column (``t/_i_table``, arrays of 131,072 rows)."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("tables")
    df = pd.DataFrame({"a": np.arange(n, dtype=np.float64), "b": np.arange(n) % 5})
    df["note"] = [f"n{i}" for i in range(n)]
    df.to_hdf(path, key="t", format="table", **to_hdf)
    with h5py.File(path) as f:
        assert "t/_i_table" in f  # what crowded out the data before
    return path


@pytest.mark.timeout(60)
def test_inspect_offers_a_pandas_tables_fields_not_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`asynchdf5 inspect frame.h5` (no --tops): the table's fields are the offered tops, and
    PyTables' index arrays (the largest datasets of the file) are none."""
    path = _pandas_table(tmp_path / "frame.h5", 300)
    status, text, err = run_main(["inspect", "--json", path], capsys)
    assert status == 0, err
    offered = json.loads(text)["offered"]
    fields = ["t/table/index", "t/table/values_block_0", "t/table/values_block_1"]
    assert offered["sets"][0] == {"rows": 300, "tops": fields}
    refused = [r["name"] for r in offered["refused"]]
    assert "t/table/values_block_2" in refused  # strings
    named = [t for s in offered["sets"] for t in s["tops"]] + refused
    assert not [t for t in named if "_i_table" in t], named


def test_a_missing_pandas_column_says_where_pandas_keeps_it(tmp_path: Path) -> None:
    """A column named as a field: the message says how pandas stores columns (blocks, or a
    field per column with data_columns=True), lists the table's fields rather than PyTables'
    index arrays, and a field's typo gets its closest field."""
    path = _pandas_table(tmp_path / "frame.h5", 50)
    with pytest.raises(SchemaError) as err:
        _open(path, tops=("t/table/a",))
    check_message(err.value, "values_block_0", "data_columns=True", "'/t/table (fields index")
    assert "_i_table" not in str(err.value)
    path = _pandas_table(tmp_path / "columns.h5", 50, data_columns=True)
    with pytest.raises(SchemaError) as err:
        _open(path, tops=("t/table/A",))
    check_message(err.value, "Did you mean 't/table/a'?")
    assert "data_columns" not in str(err.value) and "_i_table" not in str(err.value)


def test_a_pandas_column_named_without_its_table_gets_the_field_that_holds_it(
    tmp_path: Path,
) -> None:
    """``t/a`` for a column of the pandas table ``t``: a data column is the field
    ``t/table/a`` (too short a name for the closest-name match to find), and a column kept in
    a block of columns of its dtype is named with the block and its place there."""
    path = _pandas_table(tmp_path / "columns.h5", 50, data_columns=["a"])
    with pytest.raises(SchemaError) as err:
        _open(path, tops=("t/a",))
    check_message(err.value, "Did you mean 't/table/a'?")
    assert "values_block" not in str(err.value).split("The file has")[0]
    path = _pandas_table(tmp_path / "blocks.h5", 50)
    for top in ("t/b", "/t/table/b"):
        with pytest.raises(SchemaError) as err:
            _open(path, tops=(top,))
        check_message(
            err.value,
            "Did you mean 't/table/values_block_1'?",
            "column 'b' there, as its column 0",
            "data_columns=True",
        )
    # Names past ASCII (and a backslash) are escaped in PyTables' record of the block's columns.
    pd = pytest.importorskip("pandas")
    path = tmp_path / "names.h5"
    df = pd.DataFrame({"prix_é": np.arange(5.0), "a\\b": np.ones(5), "数量": np.arange(5)})
    df.to_hdf(path, key="t", format="table")
    for column, block, at in (("prix_é", 0, 0), ("a\\b", 0, 1), ("数量", 1, 0)):
        with pytest.raises(SchemaError) as err:
            _open(path, tops=(f"t/{column}",))
        check_message(
            err.value, f"'t/table/values_block_{block}'", f"{column!r} there, as its column {at}"
        )


@pytest.mark.timeout(60)
def test_bench_reads_fields_into_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench's in-RAM ceiling loads a field as the layer reads it (it opened the field's path
    as a dataset, and `bench frame.h5` of a pandas table crashed with a KeyError)."""
    from asynchdf5._cli import _limits

    loaded: list[np.ndarray] = []
    real_gather = _limits.gather_epoch

    def gather(arrays: list[np.ndarray], *args: object) -> None:
        loaded.extend(np.array(a) for a in arrays)
        real_gather(arrays, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_limits, "gather_epoch", gather)
    source = _compound_file(tmp_path / "c.h5")
    tops = ("g/table/index", "g/table/values", "g/table/code")
    status, text, err = run_main(["bench", source, "--json", "--tops", *tops], capsys)
    assert status == 0, err
    assert json.loads(text)["in_ram"]["samples"] == N
    index, values, code = loaded
    np.testing.assert_array_equal(index, np.arange(N))
    np.testing.assert_array_equal(values, np.arange(N)[:, None] * 10 + np.arange(3))
    np.testing.assert_array_equal(code, np.arange(N) % 7)


def test_each_h5py_warning_speaks_of_its_own_top(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning per top read through h5py, each with that top's reason alone: they quoted
    the source's verdict on another top ("copied: top 'g/table/index' ...") under every one."""
    source = _compound_file(tmp_path / "c.h5")
    with caplog.at_level(logging.WARNING, logger="asynchdf5"):
        _open(source, tops=("g/table/index", "g/table/code"))
    warned = [r.getMessage() for r in caplog.records if "is read through h5py" in r.getMessage()]
    assert len(warned) == 2, warned
    for top, text in zip(("g/table/index", "g/table/code"), warned, strict=True):
        assert text.startswith(f"top {top!r} is read through h5py"), text
        assert "(a field of a compound dataset)" in text and "copied:" not in text, text
