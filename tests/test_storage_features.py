"""Storage features of HDF5 against the layer's read paths: the rows h5py reads, or a named error.

Each case writes a small real file with h5py (a row top "data" and a "label"), then runs the
whole pipeline (shuffled, two epochs, chunks smaller than the data set; copied and mapped; the
async and the sync layer) and checks every epoch yields every sample exactly once with each
top's rows equal to what h5py reads for those samples. Cases the fast paths already cover by
name (tests/test_read.py LAYOUTS, tests/test_mmap.py) are not repeated here.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, HDF5DataLayer, ReadError, SchemaError, SourceError

from ._files import check_exactly_once

pytestmark = pytest.mark.anyio

N = 1_003
SHAPE = (3,)


def _data(n: int = N, dtype: Any = np.float32) -> np.ndarray:
    base = np.arange(n * 3, dtype=np.int64).reshape(n, *SHAPE)
    if np.dtype(dtype) == np.bool_:
        return np.asarray(base % 3 == 0)
    if np.dtype(dtype).kind == "c":
        return (base + 1j * base).astype(dtype)
    if np.dtype(dtype).kind == "S":
        return np.char.encode(base.astype("U8"), "ascii").astype(dtype)
    return base.astype(dtype)


def _plain(path: Path, **kw: Any) -> Path:
    dtype = kw.pop("dtype", np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=_data(dtype=dtype), **kw)
        f["label"] = np.arange(N)
    return path


def _virtual(path: Path, same_file: bool = False) -> Path:
    half = N // 2
    parts = [(0, half), (half, N)]
    layout = h5py.VirtualLayout(shape=(N, *SHAPE), dtype=np.float32)
    data = _data()
    with h5py.File(path, "w") as f:
        for i, (a, b) in enumerate(parts):
            if same_file:
                f.create_dataset(f"src{i}", data=data[a:b])
                src = h5py.VirtualSource(".", f"src{i}", shape=(b - a, *SHAPE))
            else:
                other = path.with_name(f"{path.stem}_src{i}.h5")
                with h5py.File(other, "w") as g:
                    g["d"] = data[a:b]
                src = h5py.VirtualSource(other.name, "d", shape=(b - a, *SHAPE))
            layout[a:b] = src
        f.create_virtual_dataset("data", layout)
        f["label"] = np.arange(N)
    return path


def _virtual_with_a_gap(path: Path) -> Path:
    """Rows 500: are mapped to no source: HDF5 reads the virtual dataset's fill value there."""
    other = path.with_name("source.h5")
    with h5py.File(other, "w") as g:
        g["d"] = _data(500)
    layout = h5py.VirtualLayout(shape=(N, *SHAPE), dtype=np.float32)
    layout[:500] = h5py.VirtualSource(other.name, "d", shape=(500, *SHAPE))
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("data", layout, fillvalue=-1)
        f["label"] = np.arange(N)
    return path


def _split_3d(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        data = np.arange(N * 12, dtype=np.float32).reshape(N, 3, 4)
        f.create_dataset("data", data=data, chunks=(77, 2, 3), compression="gzip")
        f["label"] = np.arange(N)
    return path


def _filter_mask(shuffle: bool) -> Callable[[Path], Path]:
    """Every other chunk stored with gzip skipped (its filter mask bit set), as HDF5 stores a
    chunk an optional filter failed on: that chunk must not be inflated."""

    def write(path: Path) -> Path:
        data = _data()
        with h5py.File(path, "w") as f:
            d = f.create_dataset(
                "data", (N, 3), np.float32, chunks=(100, 3), compression="gzip", shuffle=shuffle
            )
            for i, r in enumerate(range(0, N, 100)):
                block = np.zeros((100, 3), np.float32)
                block[: min(100, N - r)] = data[r : r + 100]
                shuffled = block.view(np.uint8).reshape(-1, 4).T  # HDF5's shuffle of 4-byte items
                raw = shuffled.tobytes() if shuffle else block.tobytes()
                skipped = 0b10 if shuffle else 0b1  # gzip's bit: after shuffle, or alone
                stored, mask = (raw, skipped) if i % 2 else (zlib.compress(raw), 0)
                d.id.write_direct_chunk((r, 0), stored, filter_mask=mask)
            f["label"] = np.arange(N)
        return path

    return write


def _external(path: Path) -> Path:
    data = _data()
    raw = path.with_suffix(".raw")
    half = data[: N // 2].nbytes
    data.tofile(raw)
    with h5py.File(
        path, "w"
    ) as f:  # two segments, at absolute paths (relative ones are to the cwd)
        ext = [(str(raw), 0, half), (str(raw), half, data.nbytes - half)]
        f.create_dataset("data", data.shape, data.dtype, external=ext)
        f["label"] = np.arange(N)
    return path


def _external_link(path: Path) -> Path:
    other = path.with_name("target.h5")
    with h5py.File(other, "w") as g:
        g["real"] = _data()
    with h5py.File(path, "w") as f:
        f["data"] = h5py.ExternalLink(other.name, "real")
        f["label"] = np.arange(N)
    return path


def _soft_link_nested(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("a/b/c/real", data=_data(), chunks=(100, 3), compression="gzip")
        f["data"] = h5py.SoftLink("/a/b/c/real")
        f["label"] = np.arange(N)
    return path


def _grown(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        d = f.create_dataset("data", (10, 3), np.float32, maxshape=(None, 3), chunks=(64, 3))
        d.resize((N, 3))
        d[:300] = _data()[:300]
        d[700:800] = _data()[700:800]
        f["label"] = np.arange(N)
    return path


def _fill(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        d = f.create_dataset("data", (N, 3), np.float32, chunks=(64, 3), fillvalue=-2.5)
        d[100:200] = _data()[100:200]
        f["label"] = np.arange(N)
    return path


def _latest(chunks: tuple[int, ...], maxshape: Any) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        with h5py.File(path, "w", libver="latest") as f:
            f.create_dataset("data", data=_data(), chunks=chunks, maxshape=maxshape)
            f["label"] = np.arange(N)
        return path

    return write


def _file_kw(**fkw: Any) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        with h5py.File(path, "w", **fkw) as f:
            f.create_dataset("data", data=_data(), chunks=(100, 3))
            f.create_dataset("contig", data=_data())
            f["label"] = np.arange(N)
        return path

    return write


CASES: dict[str, Callable[[Path], Path]] = {
    "virtual, two source files": _virtual,
    "virtual, the same file": lambda p: _virtual(p, same_file=True),
    "external raw storage": _external,
    "external link": _external_link,
    "soft link into nested groups": _soft_link_nested,
    ">i8 contiguous": lambda p: _plain(p, dtype=">i8"),
    ">i8 chunked gzip": lambda p: _plain(p, dtype=">i8", chunks=(100, 3), compression="gzip"),
    "float16 chunked": lambda p: _plain(p, dtype=np.float16, chunks=(100, 3)),
    "bool": lambda p: _plain(p, dtype=np.bool_, chunks=(100, 3)),
    "complex64": lambda p: _plain(p, dtype=np.complex64),
    "fletcher32 alone": lambda p: _plain(p, chunks=(100, 3), fletcher32=True),
    "gzip, no shuffle": lambda p: _plain(p, chunks=(100, 3), compression="gzip", shuffle=False),
    "shuffle alone": lambda p: _plain(p, chunks=(100, 3), shuffle=True),
    "scaleoffset float": lambda p: _plain(p, chunks=(100, 3), scaleoffset=2),
    "gzip+fletcher32": lambda p: _plain(p, chunks=(100, 3), compression="gzip", fletcher32=True),
    "lzf+shuffle+fletcher32": lambda p: _plain(
        p, chunks=(100, 3), compression="lzf", shuffle=True, fletcher32=True
    ),
    "chunks split rows (3 dims)": _split_3d,
    "chunks of one row": lambda p: _plain(p, chunks=(1, 3)),
    "virtual, a region mapped to no source": _virtual_with_a_gap,
    "szip (through h5py)": lambda p: _plain(p, chunks=(100, 3), compression="szip"),
    "filter mask: gzip skipped in some chunks": _filter_mask(shuffle=False),
    "filter mask: shuffle kept, gzip skipped": _filter_mask(shuffle=True),
    "scaleoffset int": lambda p: _plain(p, dtype=np.int32, chunks=(100, 3), scaleoffset=0),
    "chunk larger than the layer's chunk": lambda p: _plain(p, chunks=(1003, 3)),
    "chunks split rows (2 dims)": lambda p: _plain(p, chunks=(100, 1), compression="gzip"),
    "grown with resize, partly written": _grown,
    "non-default fillvalue, unwritten chunks": _fill,
    "latest: fixed array": _latest((100, 3), None),
    "latest: extensible array": _latest((100, 3), (None, 3)),
    "latest: v2 B-tree": _latest((100, 3), (None, None)),
    "track_order": _file_kw(track_order=True),
    "userblock": _file_kw(userblock_size=512),
    "paged file space": _file_kw(fs_strategy="page", fs_page_size=4096),
}


def _expected(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {"data": f["data"][()], "label": f["label"][()]}


def _check(batches: list[Any], want: dict[str, np.ndarray]) -> None:
    check_exactly_once((b.indices for b in batches), len(want["label"]))
    for b in batches:
        i = np.asarray(b.indices)
        for top, rows in want.items():
            np.testing.assert_array_equal(np.asarray(b[top]), rows[i], err_msg=top)


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("name", list(CASES))
async def test_rows_are_what_h5py_reads(tmp_path: Path, name: str, mmap: bool) -> None:
    path = CASES[name](tmp_path / "f.h5")
    want = _expected(path)
    kw: dict[str, Any] = dict(
        tops=("data", "label"), batch_size=64, shuffle=True, seed=1, chunk_size=256
    )
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(path, mmap=mmap, **kw) as layer:
            for _ in range(2):
                _check([b async for b in layer], want)
    with HDF5DataLayer(path, mmap=mmap, **kw) as sync:
        _check(list(sync), want)


def _whole(path: Path, data: Any, label: Any) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data)
        f["label"] = label
    return path


def _relative_external(path: Path) -> Path:
    """The raw file beside the HDF5 file, named relative: HDF5 resolves it against the cwd."""
    data = _data()
    data.tofile(path.with_suffix(".raw"))
    with h5py.File(path, "w") as f:
        ext = [(path.with_suffix(".raw").name, 0, data.nbytes)]
        f.create_dataset("data", data.shape, data.dtype, external=ext)
        f["label"] = np.arange(N)
    return path


COMPOUND = np.zeros(N, dtype=[("a", "<f4"), ("b", "<i8")])

REFUSED: dict[str, tuple[Callable[[Path], Path], type[Exception], str]] = {
    "fixed-length strings": (
        lambda p: _plain(p, dtype="S8", chunks=(100, 3), compression="lzf"),
        SchemaError,
        r"f\.h5: top 'data' holds strings of fixed length",
    ),
    "compound (its fields are tops)": (
        lambda p: _whole(p, COMPOUND, np.arange(N)),
        SchemaError,
        r"f\.h5: top 'data' has a compound dtype .* 'data/a', 'data/b'",
    ),
    "scalar": (
        lambda p: _whole(p, np.float32(1), np.int64(1)),
        SchemaError,
        r"f\.h5: top 'data' is a scalar",
    ),
    "0 rows": (
        lambda p: _whole(p, np.zeros((0, 3), np.float32), np.zeros(0, np.int64)),
        SourceError,
        "hold no samples",
    ),
    "external raw file not found from the cwd": (
        _relative_external,
        SourceError,
        r"f\.h5: top 'data' keeps its data in the external file .*f\.raw', which does not exist",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
async def test_what_the_layer_cannot_read_is_a_named_error_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    write, error, match = REFUSED[name]
    path = write(tmp_path / "f.h5")
    monkeypatch.chdir(tmp_path.parent)  # not where a relative external file is
    with anyio.fail_after(30), pytest.raises(error, match=match):
        async with AsyncHDF5DataLayer(path, tops=("data", "label"), batch_size=64):
            pass


@pytest.mark.parametrize("mmap", [False, True])
async def test_a_corrupt_fletcher32_chunk_is_a_read_error_not_wrong_rows(
    tmp_path: Path, mmap: bool
) -> None:
    path = _plain(tmp_path / "f.h5", chunks=(100, 3), fletcher32=True)
    with h5py.File(path) as f:
        offset = f["data"].id.get_chunk_info(3).byte_offset
    with open(path, "r+b") as fh:  # flip one byte of chunk 3 (rows 300:400)
        fh.seek(offset + 5)
        byte = fh.read(1)[0]
        fh.seek(offset + 5)
        fh.write(bytes([byte ^ 0xFF]))
    want = _expected_rows_but_chunk_3(path)
    match = r"f\.h5: top 'data', rows 300:400: .*Fletcher-32 checksum mismatch"
    with anyio.fail_after(30), pytest.raises(ReadError, match=match):
        async with AsyncHDF5DataLayer(
            path, tops=("data", "label"), batch_size=64, chunk_size=256, mmap=mmap
        ) as layer:
            async for b in layer:  # rows yielded before the error are right
                i = np.asarray(b.indices)
                assert not ((i >= 300) & (i < 400)).any()
                np.testing.assert_array_equal(np.asarray(b["data"]), want[i])


def _expected_rows_but_chunk_3(path: Path) -> np.ndarray:
    with h5py.File(path) as f:
        return np.concatenate([f["data"][:300], np.full((100, 3), np.nan), f["data"][400:]])


async def test_a_file_held_by_a_swmr_writer_is_a_named_error_at_open(tmp_path: Path) -> None:
    path = tmp_path / "f.h5"
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("data", data=_data(200), maxshape=(None, 3), chunks=(50, 3))
        f.create_dataset("label", data=np.arange(200), maxshape=(None,), chunks=(50,))
    script = (
        "import sys, h5py\n"
        "f = h5py.File(sys.argv[1], 'a', libver='latest'); f.swmr_mode = True\n"
        "d = f['data']; d.resize((300, 3)); d[200:] = 1; d.flush()\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        with anyio.fail_after(30), pytest.raises(SourceError, match=r"f\.h5.*already open"):
            async with AsyncHDF5DataLayer(path, tops=("data", "label"), batch_size=64):
                pass
    finally:
        writer.communicate("", timeout=30)
