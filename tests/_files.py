"""Shared test data: HDF5 files whose rows encode their global index, and checks on batches.

Row ``i`` of a source has ``label == i`` and ``data == [10 * i, 10 * i + 1]``, so a batch is
correct when its labels equal its ``indices`` and its data agree with both: alignment and
exactly-once are checkable from the batches alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import numpy.typing as npt
import pytest

import asynchdf5._sizing
from asynchdf5 import Batch

#: The layouts ``write_h5`` writes, and the read path the layer takes for each.
LAYOUTS = {
    "contiguous": "pread",
    "chunked": "chunks",
    "gzip": "chunks",
    "fletcher32": "chunks",
    "gzip-split": "chunks",  # chunks that split a sample: read in bands of chunks
    "fletcher32-split": "chunks",
    "scaleoffset": "h5py",  # a filter without a decoder here: only h5py reads it
    "lz4": "chunks",  # hdf5plugin's filters, decoded here (the codecs extra writes them)
    "bzip2": "chunks",
}


SIZES = (100, 150, 50)  # three files, 300 samples
ROW_BYTES = 2 * 4 + 8  # a row of every top: float32[2] + int64
N = sum(SIZES)


#: A sample shape of more than one axis (small "images"), for tests that want one.
IMAGE = (3, 4)


def rows(start: int, n: int, shape: tuple[int, ...] = (2,)) -> dict[str, np.ndarray]:
    """Rows ``start:start + n`` of the source: the label is the global index ``i``, and a
    sample's data are ``10 * i`` plus their flat position in the sample."""
    idx = np.arange(start, start + n, dtype=np.int64)
    offsets = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    data = idx.reshape(-1, *([1] * len(shape))) * 10 + offsets
    return {"data": data.astype(np.float32), "label": idx}


def write_h5(
    path: Path,
    start: int,
    n: int,
    *,
    layout: str = "contiguous",
    shape: tuple[int, ...] = (2,),
    **extra: Any,
) -> Path:
    """One HDF5 file with rows ``start:start + n`` (samples of ``shape``); ``extra`` datasets
    replace or add tops."""
    kwargs: dict[str, Any] = {}
    if layout == "chunked":
        kwargs = {"chunks": True}
    elif layout.startswith("gzip"):
        kwargs = {"chunks": True, "compression": "gzip"}
    elif layout.startswith("fletcher32"):
        kwargs = {"chunks": True, "fletcher32": True}
    elif layout == "scaleoffset":  # lossless here: the values are whole numbers
        kwargs = {"chunks": True, "scaleoffset": 0}
    elif layout in ("lz4", "bzip2"):
        hdf5plugin = pytest.importorskip("hdf5plugin")
        kwargs = {"chunks": True, **(hdf5plugin.LZ4() if layout == "lz4" else hdf5plugin.BZip2())}
    with h5py.File(path, "w") as f:
        for name, arr in rows(start, n, shape).items():
            if name not in extra:
                # "...-split": chunks that split a sample.
                shape = (1,) * (arr.ndim - 1) if layout.endswith("-split") else arr.shape[1:]
                chunks = (8, *shape) if kwargs else None
                f.create_dataset(name, data=arr, **{**kwargs, "chunks": chunks})
        for name, value in extra.items():
            if value is not None:
                f.create_dataset(name, data=value)
    return path


def write_source(
    folder: Path,
    sizes: Sequence[int] = SIZES,
    *,
    layout: str = "contiguous",
    shape: tuple[int, ...] = (2,),
) -> tuple[Path, list[Path]]:
    """Files ``part{i}.h5`` with consecutive global indices, and a list file naming them (the
    folder is made if need be)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    start = 0
    for i, n in enumerate(sizes):
        paths.append(write_h5(folder / f"part{i}.h5", start, n, layout=layout, shape=shape))
        start += n
    lst = folder / "train.txt"
    lst.write_text("# fixture\n\n" + "\n".join(p.name for p in paths) + "\n")
    return lst, paths


def write_bad_file(folder: Path, kind: str) -> Path:
    """Write a good source (``write_source``) whose second file is replaced by something bad of
    ``kind`` (missing, text, zero-byte, directory, corrupt); return that path."""
    _, paths = write_source(folder)
    bad = paths[1]
    bad.unlink()
    if kind == "text":
        bad.write_text("data,label\n1,2\n")
    elif kind == "zero-byte":
        bad.touch()
    elif kind == "directory":
        bad.mkdir()
    elif kind == "corrupt":
        # The HDF5 signature, then garbage: passes the signature check, fails in HDF5.
        bad.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    return bad


def write_list(folder: Path, names: Sequence[str]) -> Path:
    lst = folder / "train.txt"
    lst.write_text("\n".join(names) + "\n")
    return lst


def check_batch(batch: Batch, batch_size: int) -> None:
    """A yielded batch is complete (every top has every row) and aligned (rows are its indices)."""
    assert batch.indices.dtype == np.int64
    assert batch.size == batch_size
    assert set(batch) == {"data", "label"}
    np.testing.assert_array_equal(batch["label"], batch.indices)
    np.testing.assert_array_equal(batch["data"][:, 0], batch.indices * 10)
    np.testing.assert_array_equal(batch["data"][:, 1], batch.indices * 10 + 1)


def check_prefix(batches: Sequence[Batch], batch_size: int) -> np.ndarray:
    """Unshuffled batches before an error: complete, correct and in source order from row 0."""
    for b in batches:
        check_batch(b, batch_size)
    seen = np.concatenate([b.indices for b in batches]) if batches else np.empty(0, np.int64)
    np.testing.assert_array_equal(seen, np.arange(len(seen)))
    return seen


def check_epoch(batches: Sequence[Batch], n: int, batch_size: int, epoch: int) -> None:
    """A whole epoch: every sample exactly once, full batches but for the last."""
    assert batches
    for b in batches[:-1]:
        check_batch(b, batch_size)
    check_batch(batches[-1], batches[-1].size)
    assert 0 < batches[-1].size <= batch_size
    assert {b.epoch for b in batches} == {epoch}
    check_exactly_once([b.indices for b in batches], n)


def check_exactly_once(indices: Iterable[npt.ArrayLike], n: int) -> np.ndarray:
    """Every sample ``0 .. n - 1`` exactly once among ``indices`` (batches' global indices, in
    any order, from any number of ranks or epochs' parts); returns them, concatenated."""
    parts = [np.asarray(i, np.int64) for i in indices]
    seen = np.concatenate(parts) if parts else np.empty(0, np.int64)
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))
    return seen


def split_refused(n: int, batch_size: int, world_size: int, drop_last: bool) -> bool:
    """Whether ``n`` samples cannot be split into batches of ``batch_size`` over ``world_size``
    ranks (the layer refuses them at open; the bad-input tests cover those): fewer samples than
    ranks, no full round with ``drop_last``, or a leftover smaller than ``world_size`` with no
    full batch (or batches of one row) to split."""
    q, r = divmod(n, world_size * batch_size)
    if n < world_size or (drop_last and q == 0):
        return True
    return not drop_last and 0 < r < world_size and (q == 0 or batch_size == 1)


def check_message(exc: BaseException, *parts: object) -> None:
    """The message names every one of ``parts`` (a path is matched by its full text)."""
    msg = str(exc)
    for p in parts:
        assert str(p) in msg, f"{str(p)!r} not in message {msg!r}"


@contextmanager
def ramp(rows: int | None, lane_rows: int = 1) -> Iterator[None]:
    """Make the first chunk of every epoch ramp up from ``rows`` rows (None: the default), its
    pieces taken from lanes of at least ``lane_rows`` rows (when shuffled)."""
    shape = vars(asynchdf5._sizing)  # the module's globals, as its functions read them
    saved = shape["RAMP_BYTES"], shape["MIN_LANE_BYTES"]
    if rows is not None:
        shape["RAMP_BYTES"] = rows * ROW_BYTES
        shape["MIN_LANE_BYTES"] = lane_rows * ROW_BYTES
    try:
        yield
    finally:
        shape["RAMP_BYTES"], shape["MIN_LANE_BYTES"] = saved
