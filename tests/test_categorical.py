"""Categorical groups as tops (issue 41, item 2): AnnData's ``obs/cell_type`` (``codes`` +
``categories``, ``encoding-type="categorical"``) yields its integer codes, and the layer says
the category names in code order; files (or streams) whose categories differ are refused at
open, before any batch."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer, MemoryDataLayer, SchemaError, Stream

from ._helpers import DEADLINE, run_main

CATS = ("B cell", "T cell", "monocyte")


def _anndata_file(path: Path, n: int, cats: tuple[str, ...] = CATS, seed: int = 0) -> Path:
    """An ``.h5ad`` written by the real ``anndata`` package: ``obs/cell_type`` categorical,
    ``obs/row`` the row number, X dense (the row number in every column)."""
    ad = pytest.importorskip("anndata")
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, len(cats), n)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical.from_codes(codes, categories=list(cats)),
            "row": np.arange(n, dtype=np.int64),
        },
        index=[f"c{i}" for i in range(n)],
    )
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 5, axis=1)
    with _quiet():
        ad.AnnData(X=x, obs=obs).write_h5ad(path)
    return path


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """anndata may warn (about its own future) while writing: not this test's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _names(path: Path) -> list[str]:
    ad = pytest.importorskip("anndata")
    with _quiet():
        a = ad.read_h5ad(path)
    return [str(v) for v in a.obs["cell_type"]]


@pytest.mark.timeout(DEADLINE * 2)
@pytest.mark.parametrize("process", [False, True])
def test_an_anndata_categorical_is_its_codes_and_names(tmp_path: Path, process: bool) -> None:
    paths = [_anndata_file(tmp_path / "a.h5ad", 70), _anndata_file(tmp_path / "b.h5ad", 45, seed=1)]
    truth = _names(paths[0]) + _names(paths[1])
    with HDF5DataLayer(
        paths,
        tops=("X", "obs/cell_type", "obs/row"),
        batch_size=16,
        shuffle=True,
        seed=2,
        process=process,
    ) as layer:
        names = layer.categories["obs/cell_type"]
        assert names == CATS
        seen = []
        for batch in layer:
            codes = np.array(batch["obs/cell_type"])
            assert codes.dtype == np.int8  # as AnnData stores them
            for g, c in zip(batch.indices, codes, strict=True):
                assert names[c] == truth[g]  # the code names the row's category
                seen.append(int(g))
            # rows of all tops are the same samples: X holds the row number in its file
            rows = np.array(batch["obs/row"])
            np.testing.assert_array_equal(np.array(batch["X"])[:, 0], rows)
        assert sorted(seen) == list(range(115))


def test_categories_are_known_before_open_and_on_the_torch_dataset(tmp_path: Path) -> None:
    path = _anndata_file(tmp_path / "a.h5ad", 30)
    layer = HDF5DataLayer(path, tops=("obs/cell_type",), batch_size=8)
    try:
        assert layer.categories == {"obs/cell_type": CATS}  # like len(): reads the metadata
        assert len(layer) == 4
    finally:
        layer.close()
    pytest.importorskip("torch")
    from asynchdf5.torch import HDF5IterableDataset

    ds = HDF5IterableDataset(path, tops=("obs/cell_type", "X"), batch_size=8)
    try:
        assert ds.categories["obs/cell_type"] == CATS
    finally:
        ds.close()
    with MemoryDataLayer({"x": np.zeros(4)}, batch_size=2) as mem:
        assert mem.categories == {}


@pytest.mark.timeout(DEADLINE)
def test_files_or_streams_that_disagree_on_categories_are_refused(tmp_path: Path) -> None:
    a = _anndata_file(tmp_path / "a.h5ad", 20)
    b = _anndata_file(tmp_path / "b.h5ad", 20, cats=("B cell", "monocyte", "T cell"))
    with pytest.raises(SchemaError, match=r"b\.h5ad: top 'obs/cell_type' has the categories"):
        with HDF5DataLayer([a, b], tops=("obs/cell_type",), batch_size=4):
            pass
    with pytest.raises(SchemaError, match=r"stream 'two': .*same category in every file"):
        with HDF5DataLayer(
            {"one": Stream([a]), "two": Stream([b])}, tops=("obs/cell_type",), batch_size=4
        ):
            pass
    # A categorical in one file, a plain dataset of codes in the other: codes would mislead.
    c = tmp_path / "c.h5"
    with h5py.File(c, "w") as f:
        f["obs/cell_type"] = np.zeros(20, np.int8)
    with pytest.raises(SchemaError, match=r"is a categorical group in .*a\.h5ad and not in"):
        with HDF5DataLayer([a, c], tops=("obs/cell_type",), batch_size=4):
            pass


@pytest.mark.timeout(DEADLINE)
def test_a_plain_codes_and_categories_group_and_bad_groups(tmp_path: Path) -> None:
    p = tmp_path / "p.h5"
    with h5py.File(p, "w") as f:
        g = f.create_group("label")  # no encoding attribute: the two datasets say it
        g["codes"] = np.arange(12, dtype=np.int16) % 3
        g["categories"] = np.array([10, 20, 30])
        bad = f.create_group("bad")
        bad.attrs["encoding-type"] = "categorical"
        bad["codes"] = np.zeros(12, np.int8)
        f["other/codes"] = np.zeros(12, np.int8)  # a group, not categorical
        f["other/more"] = np.zeros(12, np.int8)
    with HDF5DataLayer(p, tops=("label",), batch_size=5) as layer:
        assert layer.categories == {"label": (10, 20, 30)}
        got = np.concatenate([np.array(b["label"]) for b in layer])
    np.testing.assert_array_equal(got, np.arange(12) % 3)
    with pytest.raises(SchemaError, match=r"'bad' is a categorical group, but does not hold"):
        with HDF5DataLayer(p, tops=("bad",), batch_size=5):
            pass
    neither = r"'other' is a group holding codes, more, which is neither form"
    with pytest.raises(SchemaError, match=neither):
        with HDF5DataLayer(p, tops=("other",), batch_size=5):
            pass


def test_kept_catalog_still_reads_the_names(tmp_path: Path) -> None:
    """The catalog kept between runs holds no category names: a second run reads them again."""
    paths = [_anndata_file(tmp_path / f"{i}.h5ad", 10, seed=i) for i in range(3)]
    listed = tmp_path / "list.txt"
    listed.write_text("".join(f"{p}\n" for p in paths))
    for _ in range(2):
        kw: dict[str, Any] = {"tops": ("obs/cell_type", "obs/row"), "batch_size": 4}
        with HDF5DataLayer(listed, **kw) as layer:
            assert layer.categories == {"obs/cell_type": CATS}


@pytest.mark.timeout(DEADLINE)
def test_the_encoding_anndata_wrote_before_0_8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Codes as an integer dataset whose ``categories`` attribute references the names."""
    p = tmp_path / "old.h5ad"
    with h5py.File(p, "w") as f:
        names = f.create_dataset("obs/__categories/cell_type", data=np.array([b"a", b"b"]))
        codes = f.create_dataset("obs/cell_type", data=np.array([1, 0, 1, 1, 0], np.int8))
        codes.attrs["categories"] = names.ref
    with HDF5DataLayer(p, tops=("obs/cell_type",), batch_size=2) as layer:
        assert layer.categories == {"obs/cell_type": ("a", "b")}
        got = np.concatenate([np.array(b["obs/cell_type"]) for b in layer])
    np.testing.assert_array_equal(got, [1, 0, 1, 1, 0])
    status, text, _ = run_main(["inspect", p, "--tops", "obs/cell_type"], capsys)
    assert status == 0 and "obs/cell_type: categorical: 2 categories named by" in text
