"""Bad inputs, part 1 (the source list, its files and their tops): each raises the right error,
names what is wrong, leaks nothing.

Every error is checked for its class *and* for a message that names the file, the top, the rows
or the transformer involved. Configuration errors are raised at construction; source and schema
errors at the first call that needs the files (``len()``, ...) or when the layer is opened,
before any batch; read and transform errors from the ``async for`` (or ``for``) that was
waiting, after only complete, correct batches. After leaving ``async with`` (or ``with``) no
task, busy thread or file descriptor of ours may be left behind.

The data (``_files``; the ``source`` fixture: a list file naming three files, 300 samples) make
alignment checkable from the batch alone: row ``i`` has ``label == i`` and ``data == [10 * i,
10 * i + 1]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    ConfigurationError,
    SchemaError,
    SourceError,
)

from ._files import (
    check_message,
    rows,
    write_bad_file,
    write_h5,
)
from ._helpers import open_must_fail
from ._leaks import assert_released, snapshot

# --------------------------------------------------------------------------------------------
# Source list and files: SourceError
# --------------------------------------------------------------------------------------------


def test_list_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(missing, batch_size=4)
    check_message(info.value, missing, "does not exist")


def test_list_file_is_a_directory(tmp_path: Path) -> None:
    # Stands in for an unreadable list file where chmod cannot make one (see the next test).
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(tmp_path, batch_size=4)
    check_message(info.value, tmp_path, "directory")


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="running as root: chmod 000 does not stop root from reading a file",
)
def test_list_file_unreadable(source: tuple[Path, list[Path]]) -> None:
    lst, _ = source
    lst.chmod(0)
    try:
        with pytest.raises(SourceError) as info:
            AsyncHDF5DataLayer(lst, batch_size=4)
    finally:
        lst.chmod(0o644)
    check_message(info.value, lst)


def test_list_file_not_text(tmp_path: Path) -> None:
    lst = tmp_path / "train.txt"
    lst.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(lst, batch_size=4)
    check_message(info.value, lst)


@pytest.mark.parametrize("text", ["", "\n\n   \n", "# only\n  # comments\n\n"])
def test_list_file_names_no_file(tmp_path: Path, text: str) -> None:
    lst = tmp_path / "train.txt"
    lst.write_text(text)
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(lst, batch_size=4)
    check_message(info.value, lst, "no HDF5 file")


@pytest.mark.parametrize("empty", [[], ()])
def test_empty_sequence(empty: Sequence[str]) -> None:
    with pytest.raises(SourceError, match="empty sequence"):
        AsyncHDF5DataLayer(empty, batch_size=4)


@pytest.mark.parametrize("bad", [b"train.txt", 3, None, [Path("a.h5"), 3]])
def test_source_of_wrong_type(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="source"):
        AsyncHDF5DataLayer(bad, batch_size=4)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("missing", "does not exist"),
        ("text", "not an HDF5 file"),
        ("zero-byte", "not an HDF5 file"),
        ("directory", "directory"),
        ("corrupt", "cannot open"),
    ],
)
async def test_listed_file_bad(tmp_path: Path, kind: str, words: str) -> None:
    bad = write_bad_file(tmp_path, kind)
    layer = AsyncHDF5DataLayer(tmp_path / "train.txt", batch_size=10)
    err = await open_must_fail(layer, SourceError)
    check_message(err, bad, words)


@pytest.mark.anyio
@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="running as root: chmod 000 does not stop root from reading a file",
)
async def test_listed_file_unreadable(source: tuple[Path, list[Path]]) -> None:
    lst, paths = source
    paths[1].chmod(0)
    try:
        err = await open_must_fail(AsyncHDF5DataLayer(lst, batch_size=10), SourceError)
    finally:
        paths[1].chmod(0o644)
    check_message(err, paths[1], "not readable")


# --------------------------------------------------------------------------------------------
# Tops: SchemaError
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_top_missing_from_second_file(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    with h5py.File(b) as f:
        assert "label" not in f
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'label'", "missing")


@pytest.mark.parametrize(
    "ask",
    [len, lambda layer: layer.n_samples, lambda layer: layer.state_dict()],
    ids=["len", "n_samples", "state_dict"],
)
def test_schema_error_comes_at_the_first_call_that_needs_the_files(
    tmp_path: Path, ask: Callable[[AsyncHDF5DataLayer], object]
) -> None:
    # docs/errors.md, moment 2: construction opens no file; len() and the like, before
    # `async with`, read the files' metadata and raise what is wrong with them, every time.
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    before = snapshot()
    layer = AsyncHDF5DataLayer([a, b], batch_size=10)
    for _ in range(2):
        with pytest.raises(SchemaError) as info:
            ask(layer)
        check_message(info.value, b, "'label'", "missing")
    assert_released(before)


@pytest.mark.anyio
async def test_tops_of_one_file_have_different_row_counts(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=np.arange(99, dtype=np.int64))
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'data': 100", "'label': 99")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (np.zeros((100, 3), np.float32), ["(3,)", "(2,)"]),  # sample shape differs
        (np.zeros((100, 2, 1), np.float32), ["(2, 1)", "(2,)"]),  # rank differs
        (np.zeros((100, 2), np.float64), ["float64", "float32"]),  # dtype differs
    ],
)
async def test_top_sample_shape_or_dtype_differs_between_files(
    tmp_path: Path, data: np.ndarray, words: list[str]
) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, data=data)
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, a, b, "'data'", *words)


def _bad_top(f: h5py.File, kind: str) -> None:
    if kind == "0-d":
        f.create_dataset("label", data=7)
    elif kind == "empty dataspace":
        f.create_dataset("label", data=h5py.Empty("i8"))
    elif kind == "compound":
        f.create_dataset("label", data=np.zeros(100, [("a", "i4"), ("b", "f4")]))
    elif kind == "fixed string":
        f.create_dataset("label", data=np.array([b"abc"] * 100, "S3"))
    elif kind == "vlen string":
        f.create_dataset("label", data=["abc"] * 100, dtype=h5py.string_dtype())
    elif kind == "vlen":
        d = f.create_dataset("label", (100,), dtype=h5py.vlen_dtype(np.int32))
        d[0] = np.arange(3, dtype=np.int32)
    elif kind == "group":
        f.create_group("label")
    elif kind == "array dtype":
        f.create_dataset("label", (100,), dtype=np.dtype(("i4", (2,))))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("0-d", "0-d"),
        ("empty dataspace", "0-d"),
        ("compound", "compound"),
        ("fixed string", "strings"),
        ("vlen string", "strings"),
        # A vlen int32 top is ragged (issue 41): here it is fixed rows in the other file.
        ("vlen", "stored as ragged"),
        ("group", "neither form"),
        ("array dtype", "dtype"),
    ],
)
async def test_unsupported_top(tmp_path: Path, kind: str, words: str) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = tmp_path / "b.h5"
    with h5py.File(b, "w") as f:
        f.create_dataset("data", data=rows(100, 100)["data"])
        _bad_top(f, kind)
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'label'", words)


@pytest.mark.anyio
async def test_every_file_empty(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 0)
    err = await open_must_fail(AsyncHDF5DataLayer([a], batch_size=10), SourceError)
    check_message(err, "no samples")
