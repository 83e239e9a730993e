"""``asynchdf5 inspect FILE`` without ``--tops`` on a file that lacks the default tops (an
AnnData ``.h5ad``, a file of unrelated datasets): what the file offers as tops, grouped by row
count, the largest set inspected as the layer reads it, and the line that opens it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer
from asynchdf5._cli._inspect import SHOWN

from ._files import write_h5
from ._helpers import run_main


def inspect_json(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, dict[str, Any]]:
    status, out, _ = run_main(["inspect", "--json", *args], capsys)
    doc: dict[str, Any] = json.loads(out)
    return status, doc


def write_h5ad(path: Path) -> None:
    """200 cells x 30 genes: a sparse X, a categorical and a numeric obs column, a var column,
    and odds and ends in uns (a string, a scalar, a short array)."""
    anndata = pytest.importorskip("anndata")
    pd = pytest.importorskip("pandas")
    sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(0)
    x = sparse.random(200, 30, density=0.1, format="csr", dtype=np.float32, random_state=0)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["T", "B", "NK"], 200)),
            "n_counts": rng.integers(0, 100, 200),
        },
        index=[f"c{i}" for i in range(200)],
    )
    var = pd.DataFrame({"mean": rng.random(30)}, index=[f"g{i}" for i in range(30)])
    uns = {"note": "hi", "scale": 2.5, "params": {"k": np.arange(5)}}
    anndata.AnnData(X=x, obs=obs, var=var, uns=uns).write_h5ad(path)


@pytest.mark.timeout(60)
def test_h5ad_offers_x_and_obs_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cells.h5ad"
    write_h5ad(path)
    status, doc = inspect_json(capsys, path)
    assert status == 0 and doc["ok"], doc["problems"]
    offered = doc["offered"]
    sets = {s["rows"]: s["tops"] for s in offered["sets"]}
    assert offered["sets"][0] == {"rows": 200, "tops": ["X", "obs/cell_type", "obs/n_counts"]}
    assert sets[30] == ["var/mean"] and sets[5] == ["uns/params/k"]
    # The members of the sparse and categorical groups are not tops, nor are scalars.
    named = {t for s in offered["sets"] for t in s["tops"]}
    assert not {"X/data", "X/indptr", "obs/cell_type/codes", "uns/scale"} & named
    assert {r["name"] for r in offered["refused"]} == {"obs/_index", "var/_index"}  # strings
    assert doc["tops"] == ["X", "obs/cell_type", "obs/n_counts"] and doc["samples"] == 200
    forms = {t["name"]: (t["form"], t["read_path"]) for t in doc["files"][0]["tops"]}
    assert forms["X"][0] == "sparse csr" and forms["obs/cell_type"][0] == "categorical"
    assert forms["var/mean"] == ("rows", "pread")  # the other sets are described too
    assert all(path for _, path in forms.values())

    status, text, _ = run_main(["inspect", path], capsys)
    assert status == 0
    assert "tops with 200 rows: X (sparse csr), obs/cell_type (categorical), obs/n_counts" in text
    assert "tops with 30 rows: var/mean" in text
    line = offered["layer"]
    assert line in text and line.startswith("HDF5DataLayer(")
    # The line opens the largest set: every cell exactly once.
    with eval(line, {"HDF5DataLayer": HDF5DataLayer}) as layer:  # our own output
        seen = sorted(i for b in layer for i in b.indices.tolist())
    assert seen == list(range(200))


def test_unrelated_datasets_grouped_by_rows_and_capped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "misc.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.zeros((50, 4, 4), np.uint8)
        f["ids"] = np.arange(50)
        f["tok/data"] = np.arange(100)  # a ragged group of 50 rows: a top, its members not
        f["tok/indptr"] = np.arange(0, 101, 2)
        f["meta/scale"] = 3.0  # a scalar: no rows
        for i in range(SHOWN + 5):  # many small tables of other lengths
            f[f"tables/t{i:02d}"] = np.ones(7 + i)
    status, doc = inspect_json(capsys, path)
    assert status == 0 and doc["ok"], doc["problems"]
    offered = doc["offered"]
    assert offered["sets"][0] == {"rows": 50, "tops": ["ids", "images", "tok"]}
    assert len(offered["sets"]) == 1 + SHOWN + 5
    assert offered["more"] == 3 + 5  # the table describes SHOWN tops in all
    assert len(doc["files"][0]["tops"]) == SHOWN
    assert doc["read_paths"] == {"ids": "pread", "images": "pread", "tok": "ragged-pread"}
    status, text, _ = run_main(["inspect", path], capsys)
    assert status == 0 and "tops with 50 rows: ids, images, tok (ragged)" in text
    assert "8 tops not described below: --tops names them" in text
    assert "tops with 7 rows" not in text  # the text lists the 8 largest sets, counts the rest
    assert f"... {SHOWN + 5 - 7} other row counts ({SHOWN + 5 - 7} tops; --json lists them)" in text
    assert len(text.splitlines()) < 80
    assert "HDF5DataLayer(" in text and "tops=('ids', 'images', 'tok'), batch_size=256)" in text


def test_default_tops_and_named_tops_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_h5(tmp_path / "a.h5", 0, 10)
    with h5py.File(tmp_path / "a.h5", "a") as f:
        f["extra"] = np.zeros(3)  # another row count: not offered, the defaults are there
    status, doc = inspect_json(capsys, tmp_path / "a.h5")
    assert status == 0 and doc["tops"] == ["data", "label"] and doc["offered"] is None
    status, text, _ = run_main(["inspect", tmp_path / "a.h5"], capsys)
    assert status == 0 and "offers" not in text
    # --tops naming a missing top still fails, with the layer's message.
    status, doc = inspect_json(capsys, tmp_path / "a.h5", "--tops", "nope")
    assert status == 1 and doc["offered"] is None and "'nope' is missing" in doc["problems"][0]


# --- bench takes the same offer ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_without_tops_benches_the_offered_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asynchdf5 bench cells.h5ad``: the tops inspect offers (one definition: ``report_on``),
    said in its output; the in-RAM ceiling skipped for the sparse X and served for a
    categorical top's codes; the raw read counts a sparse top's indices."""
    path = tmp_path / "cells.h5ad"
    write_h5ad(path)
    status, out, err = run_main(["bench", path, "--json", "--batch-size", 32], capsys)
    assert status == 0, (out, err)
    doc = json.loads(out)
    tops = ["X", "obs/cell_type", "obs/n_counts"]
    assert doc["properties"]["tops"] == tops and doc["offered"]["sets"][0]["tops"] == tops
    assert doc["samples"] == 200 and all(e["samples"] == 200 for e in doc["layer"]["epochs"])
    assert doc["in_ram"] is None and "X: ragged or sparse" in doc["in_ram_skipped"]
    assert not any(h.startswith("var/") for h in doc["hints"])  # only the benched tops'
    with h5py.File(path) as f:  # values, column indices and the obs columns, at least
        x = f["X"]
        assert doc["stored_bytes"] >= x["data"].nbytes + x["indices"].nbytes
        # A sample's bytes: its values and indices on average, its offset, and the columns.
        nnz = x["data"].shape[0]
        per_value = x["data"].dtype.itemsize + x["indices"].dtype.itemsize
        assert doc["sample_bytes"] == round(nnz * per_value / 200 + 8 + 1 + 8)
    status, text, _ = run_main(["bench", path, "--batch-size", 32, "--no-raw-read"], capsys)
    assert status == 0 and "benched the largest set of tops it offers" in text
    assert doc["offered"]["layer"] in text

    # Named tops, a categorical among them: the in-RAM ceiling gathers its codes.
    args = ["bench", path, "--json", "--tops", "obs/cell_type", "obs/n_counts"]
    status, out, err = run_main(args, capsys)
    assert status == 0, (out, err)
    doc = json.loads(out)
    assert doc["offered"] is None and doc["in_ram"]["samples"] == 200


def test_bench_without_tops_on_a_file_that_offers_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "scalar.h5"
    with h5py.File(path, "w") as f:
        f["scale"] = 3.0
    status, out, _ = run_main(["bench", path], capsys)
    assert status == 1 and "'data' is missing" in out and "FAILED" in out
