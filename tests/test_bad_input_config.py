"""Bad inputs, part 2 (keyword properties, and checks that must agree across ranks): each
raises the right error, names what is wrong, leaks nothing.

What every part checks, and the data they read: part 1, ``test_bad_input_sources``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    HDF5DataLayer,
    SchemaError,
)

from ._files import (
    N,
    check_epoch,
    check_message,
    write_h5,
    write_source,
)
from ._helpers import open_must_fail
from ._leaks import assert_released, snapshot

# --------------------------------------------------------------------------------------------
# Keyword properties: ConfigurationError at construction
# --------------------------------------------------------------------------------------------

LayerClass = Callable[..., Any]
LAYERS: list[LayerClass] = [AsyncHDF5DataLayer, HDF5DataLayer]


def _ident(x: object) -> object:
    return x


CONFIG_CASES: list[tuple[dict[str, Any], list[str]]] = [
    ({"batch_size": 0}, ["batch_size", ">= 1", "0"]),
    ({"batch_size": -3}, ["batch_size", "-3"]),
    ({"batch_size": 4.0}, ["batch_size", "int", "float"]),
    ({"batch_size": True}, ["batch_size", "int", "bool"]),
    ({"batch_size": "4"}, ["batch_size", "int", "str"]),
    ({"batch_size": None}, ["batch_size", "int"]),
    ({"batch_size": 10, "chunk_size": 9}, ["chunk_size=9", "batch_size=10"]),
    ({"batch_size": 10, "chunk_size": 0}, ["chunk_size", ">= 1"]),
    # Out of range: here, not as NumPy's error at the first batch (issue 39, item 9).
    ({"batch_size": 2**62, "chunk_size": 2**62}, ["batch_size", "<= 1099511627776", "2**40"]),
    ({"batch_size": 4, "tops": ()}, ["tops", "empty"]),
    ({"batch_size": 4, "tops": ("data", "label", "data")}, ["'data'", "twice"]),
    ({"batch_size": 4, "tops": ("data", 3)}, ["tops"]),
    ({"batch_size": 4, "transformers": [("nope", _ident)]}, ["transformers[0]", "'nope'"]),
    ({"batch_size": 4, "transformers": [("label", 3)]}, ["transformers[0]", "'label'", "callable"]),
    ({"batch_size": 4, "transformers": [_ident]}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": [("label",)]}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": [("label", _ident, 1)]}, ["transformers[0]", "pair"]),
    (
        {"batch_size": 4, "transformers": [("label", _ident), ("data", None)]},
        ["transformers[1]", "'data'", "callable"],
    ),
    ({"batch_size": 4, "transformers": ("label", _ident)}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": _ident}, ["transformers", "sequence"]),
    ({"batch_size": 4, "transformers": {"label": _ident}}, ["transformers", "sequence"]),
    ({"batch_size": 4, "rank": 2, "world_size": 2}, ["rank=2", "world_size"]),
    ({"batch_size": 4, "rank": -1, "world_size": 2}, ["rank", "-1"]),
    ({"batch_size": 4, "rank": 0, "world_size": 0}, ["world_size", "0"]),
    ({"batch_size": 4, "rank": 1.0, "world_size": 2}, ["rank", "int"]),
    ({"batch_size": 4, "shuffle": True, "world_size": 2}, ["shuffle", "world_size", "seed"]),
    ({"batch_size": 4, "shuffle": "yes"}, ["shuffle"]),
    ({"batch_size": 4, "drop_last": 1}, ["drop_last"]),
    ({"batch_size": 4, "seed": -1}, ["seed", "-1"]),
    ({"batch_size": 4, "prefetch": 0}, ["prefetch"]),
    ({"batch_size": 4, "cache_bytes": 0}, ["cache_bytes"]),
]


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "words"), CONFIG_CASES)
def test_bad_keyword_property(
    source: tuple[Path, list[Path]], cls: LayerClass, kwargs: dict[str, Any], words: list[str]
) -> None:
    before = snapshot()
    with pytest.raises(ConfigurationError) as info:
        cls(source[0], **kwargs)
    assert isinstance(info.value, ValueError)
    check_message(info.value, *words)
    assert_released(before)


def test_shuffle_with_world_size_and_a_seed_is_fine(source: tuple[Path, list[Path]]) -> None:
    AsyncHDF5DataLayer(source[0], batch_size=4, shuffle=True, world_size=2, rank=1, seed=3)


# --- needs the sample count: ConfigurationError when the layer opens --------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("batch_size", "rank", "world_size"),
    [(N + 1, 0, 1), (N, 1, 2), (100, 3, 4)],  # the last: 75 samples a rank, fewer than a batch
)
async def test_drop_last_leaves_no_batch(
    source: tuple[Path, list[Path]], batch_size: int, rank: int, world_size: int
) -> None:
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=batch_size, drop_last=True, rank=rank, world_size=world_size
    )
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, "drop_last", f"batch_size={batch_size}")


@pytest.mark.anyio
async def test_drop_last_error_names_the_sample_count(source: tuple[Path, list[Path]]) -> None:
    layer = AsyncHDF5DataLayer(source[0], batch_size=N + 1, drop_last=True)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, f"{N} samples")


@pytest.mark.anyio
async def test_world_size_larger_than_sample_count(source: tuple[Path, list[Path]]) -> None:
    layer = AsyncHDF5DataLayer(source[0], batch_size=1, rank=0, world_size=N + 1)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, f"{N} samples", f"world_size={N + 1}")


@pytest.mark.anyio
async def test_batch_larger_than_data_without_drop_last_is_one_batch(
    source: tuple[Path, list[Path]],
) -> None:
    async with AsyncHDF5DataLayer(source[0], batch_size=N + 1) as layer:
        batches = [b async for b in layer]
    check_epoch(batches, N, N + 1, 0)
    assert len(batches) == 1


# --------------------------------------------------------------------------------------------
# Checks that must agree across ranks, budgets, and messages that say what the user needs
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sizes", "batch_size", "world_size", "drop_last"),
    [
        ((3,), 4, 2, False),  # q == 0, leftover 3 >= 2: every rank gets one partial batch
        ((1,), 4, 2, False),  # fewer samples than ranks
        ((5,), 1, 3, False),  # batch_size 1, leftover 2 < 3: impossible
        ((7,), 4, 2, True),  # drop_last leaves no batch
        ((9,), 4, 2, False),  # leftover 1 < 2 with q == 1: the (B-1, 1) split
    ],
)
async def test_every_rank_gets_the_same_answer(
    tmp_path: Path, sizes: tuple[int, ...], batch_size: int, world_size: int, drop_last: bool
) -> None:
    """An impossible split fails on every rank, or on none: a rank failing alone would leave
    the others waiting in their collectives forever."""
    lst, _ = write_source(tmp_path, sizes)
    outcomes = []
    counts = []
    for rank in range(world_size):
        layer = AsyncHDF5DataLayer(
            lst, batch_size=batch_size, rank=rank, world_size=world_size, drop_last=drop_last
        )
        try:
            async with layer:
                counts.append(len([b async for b in layer]))
            outcomes.append("ok")
        except ConfigurationError as exc:
            outcomes.append(str(exc))
    assert len(set(outcomes)) == 1, outcomes
    assert len(set(counts)) <= 1


@pytest.mark.anyio
async def test_a_sample_larger_than_the_cache_budget(tmp_path: Path) -> None:
    path = write_h5(tmp_path / "big.h5", 0, 10, data=np.zeros((10, 1000), np.float64))
    layer = AsyncHDF5DataLayer([path], batch_size=1, cache_bytes=4000)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, "cache_bytes=4000", "8008 bytes", "raise cache_bytes")


@pytest.mark.anyio
async def test_a_missing_top_lists_the_datasets_the_file_has(tmp_path: Path) -> None:
    path = tmp_path / "nested.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images/train", data=np.zeros((5, 2)))
        f.create_dataset("meta/labels", data=np.arange(5))
    layer = AsyncHDF5DataLayer([path], batch_size=2, tops=("images/train", "label"))
    err = await open_must_fail(layer, SchemaError)
    check_message(err, path, "'label'", "'/images/train'", "'/meta/labels'")


def _anndata_like(path: Path) -> Path:
    """An AnnData-like file: a CSR group `X`, a categorical `obs/cell_type`, a ragged `tok`."""
    with h5py.File(path, "w") as f:
        x = f.create_group("X")
        x.attrs["encoding-type"] = "csr_matrix"
        x.attrs["shape"] = (2, 3)
        x["data"], x["indices"], x["indptr"] = np.ones(2), np.array([0, 2]), np.array([0, 1, 2])
        c = f.create_group("obs/cell_type")
        c.attrs["encoding-type"] = "categorical"
        c["codes"], c["categories"] = np.array([0, 1], np.int8), np.array([b"a", b"b"])
        t = f.create_group("tok")
        t["data"], t["indptr"] = np.arange(3), np.array([0, 1, 3])
    return path


@pytest.mark.anyio
async def test_a_per_gene_column_beside_cells_says_so(tmp_path: Path) -> None:
    """`var/...` beside `X` in an AnnData file: the row counts differ because var has a row
    per gene; the message says so (and only for an AnnData file)."""
    path = _anndata_like(tmp_path / "cells.h5ad")
    with h5py.File(path, "a") as f:
        f.attrs["encoding-type"] = "anndata"
        f["var/mean"] = np.zeros(3)
    layer = AsyncHDF5DataLayer([path], batch_size=1, tops=("X", "var/mean"))
    err = await open_must_fail(layer, SchemaError)
    check_message(err, "different row counts", "'var/mean': in an AnnData file", "row per gene")
    with h5py.File(path, "a") as f:
        del f.attrs["encoding-type"]
    layer = AsyncHDF5DataLayer([path], batch_size=1, tops=("X", "var/mean"))
    err = await open_must_fail(layer, SchemaError)
    assert "different row counts" in str(err) and "AnnData" not in str(err)


@pytest.mark.anyio
@pytest.mark.parametrize(("top", "meant"), [("x", "X"), ("obs/celltype", "obs/cell_type")])
async def test_a_missing_top_names_the_groups_read_as_tops_and_the_closest(
    tmp_path: Path, top: str, meant: str
) -> None:
    """A user of AnnData files names groups (`X`, `obs/cell_type`): the message lists them with
    their forms, leaves out the members refused as tops (`/X/data`), and points at a typo's
    closest name."""
    path = _anndata_like(tmp_path / "cells.h5ad")
    err = await open_must_fail(AsyncHDF5DataLayer([path], batch_size=1, tops=(top,)), SchemaError)
    check_message(
        err,
        repr(top),
        f"Did you mean {meant!r}?",
        "'/X' (sparse CSR)",
        "'/obs/cell_type' (categorical)",
        "'/tok' (ragged)",
        "'/obs/cell_type/codes'",
    )
    assert "/X/data" not in str(err) and "/tok/indptr" not in str(err)
