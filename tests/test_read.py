"""The read paths give exactly what h5py gives, for every storage layout and filter pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer
from asynchdf5._codecs import unsupported_filters

pytestmark = pytest.mark.anyio

N = 3000


def _plugin(name: str) -> dict[str, Any]:
    hdf5plugin = pytest.importorskip("hdf5plugin")
    return dict(getattr(hdf5plugin, name)())


LAYOUTS: dict[str, tuple[str, Any]] = {
    # name: (expected read path of "data", dataset keyword arguments or a factory)
    "contiguous": ("mmap", {}),  # the default, mmap="auto", maps a local contiguous file
    "contiguous-big-endian": ("pread", {"dtype": ">f4"}),
    "gzip-big-endian": ("chunks", {"chunks": (256, 3, 4), "compression": "gzip", "dtype": ">f4"}),
    "chunked": ("chunks", {"chunks": (256, 3, 4)}),
    "gzip": ("chunks", {"chunks": (256, 3, 4), "compression": "gzip"}),
    "gzip-shuffle": ("chunks", {"chunks": (200, 3, 4), "compression": "gzip", "shuffle": True}),
    "gzip-shuffle-fletcher32": (
        "chunks",
        {"chunks": (256, 3, 4), "compression": "gzip", "shuffle": True, "fletcher32": True},
    ),
    "lzf": ("chunks", {"chunks": (256, 3, 4), "compression": "lzf"}),
    "zstd": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("Zstd")}),
    "blosc": ("chunks", lambda: {"chunks": (256, 3, 4), **_plugin("Blosc")}),
    "bzip2 (no GIL-free decoder)": ("h5py", lambda: {"chunks": (256, 3, 4), **_plugin("BZip2")}),
    "chunks split samples": ("h5py", {"chunks": (256, 3, 2), "compression": "gzip"}),
    "compact": ("h5py", "compact"),
    "unwritten chunks (fill value)": ("h5py", "sparse"),
}


def _write(path: Path, how: Any, data: np.ndarray) -> np.ndarray:
    """Write ``data`` as the top "data" stored as ``how``; returns what h5py should read back."""
    if how == "compact":
        data = data[:1000]  # compact storage holds < 64 KiB
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(len(data))
        if how == "compact":
            space = h5py.h5s.create_simple(data.shape)
            plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            plist.set_layout(h5py.h5d.COMPACT)
            tid = h5py.h5t.py_create(data.dtype)
            h5py.h5d.create(f.id, b"data", tid, space, plist).write(
                h5py.h5s.ALL, h5py.h5s.ALL, data
            )
        elif how == "sparse":
            d = f.create_dataset("data", data.shape, data.dtype, chunks=(256, 3, 4), fillvalue=7)
            d[:1000] = data[:1000]  # later chunks are never written
            data[1000:] = 7
        else:
            kw = how() if callable(how) else dict(how)
            dtype = kw.pop("dtype", data.dtype)
            f.create_dataset("data", data=data.astype(dtype), **kw)
    return data


@pytest.mark.parametrize("name", list(LAYOUTS))
async def test_read_path_and_values_match_h5py(tmp_path: Path, name: str) -> None:
    path_expected, how = LAYOUTS[name]
    if name == "lzf" and unsupported_filters([32000]):
        path_expected = "h5py"  # python-lzf not installed
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50, (N, 3, 4)).astype(np.float32).cumsum(axis=0)  # compressible
    path = tmp_path / "f.h5"
    data = _write(path, how, data)
    n = len(data)
    with h5py.File(path, "r") as f:
        reference = f["data"][()]
    np.testing.assert_array_equal(reference, data)
    layer = AsyncHDF5DataLayer(path, batch_size=128, chunk_size=700, shuffle=True, seed=4)
    async with layer:
        seen = np.zeros(n, bool)
        async for batch in layer:
            assert batch["data"].dtype == np.float32
            np.testing.assert_array_equal(batch["data"], reference[batch.indices])
            np.testing.assert_array_equal(batch["label"], batch.indices)
            seen[batch.indices] = True
        assert seen.all()
        assert layer.stats.read_paths["data"] == path_expected
        if path_expected == "h5py":
            assert layer.stats.read_notes["data"]


async def test_chunked_files_with_different_chunking_across_files(tmp_path: Path) -> None:
    data = np.arange(2 * N * 12, dtype=np.int16).reshape(2 * N, 3, 4)
    paths = []
    for i, kw in enumerate([{"chunks": (100, 3, 4), "compression": "gzip"}, {}]):
        p = tmp_path / f"{i}.h5"
        with h5py.File(p, "w") as f:
            f.create_dataset("data", data=data[i * N : (i + 1) * N], **kw)
            f["label"] = np.arange(i * N, (i + 1) * N)
        paths.append(p)
    async with AsyncHDF5DataLayer(paths, batch_size=100, chunk_size=1000) as layer:
        got = np.concatenate([b["data"] async for b in layer])
        assert layer.stats.read_paths["data"] == "chunks+pread"
    np.testing.assert_array_equal(got, data)
