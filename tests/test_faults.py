"""Fault injection: files and their storage break before open and mid-epoch, on every read path.

Every case checks the named error (the file, the top and the rows in its message), that only
complete, correct batches came before it (the data encode their global index), and that nothing
is left running or open afterwards (the ``no_leaks`` fixture, and :func:`aassert_released` inside
the event loop).

What a fault must give, by design (docs/errors.md):

* before open: a file missing, unreadable, truncated or not HDF5, a dangling external link, an
  external raw file or virtual source missing or too short: :class:`SourceError` at
  ``async with``, before any batch;
* bytes corrupted where a codec or checksum can tell (gzip, fletcher32): :class:`ReadError` when
  that chunk is read, after every complete batch before it;
* mid-epoch, a file truncated, rewritten in place (even with its size and mtime restored), or
  its permissions changed: :class:`ReadError`; a file deleted or renamed over: the layer goes on
  reading the file it opened, consistently (no error, no mixed data); a source that HDF5 opens by
  name (external raw file on the h5py path, virtual source) deleted: :class:`ReadError`, since
  HDF5 would read fill values in its place.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    DataLayerError,
    HDF5DataLayer,
    ReadError,
    SchemaError,
    SourceError,
)

from ._files import LAYOUTS, check_batch, check_epoch, check_message, check_prefix, rows, write_h5
from ._helpers import epoch_until_error
from ._leaks import aassert_released, asnapshot

pytestmark = pytest.mark.anyio

#: Three files of 400 rows; with batches of 10 and chunks of 20 the pipeline runs ahead of the
#: consumer by a few dozen batches at most, so after the first batch the last file is unread.
BIG = (400, 400, 400)
FAST_AND_FALLBACK = ["contiguous", "gzip", "fletcher32", "gzip-split", "scaleoffset"]


def write_big(folder: Path, layout: str = "contiguous") -> tuple[Path, list[Path]]:
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, n in enumerate(BIG):
        paths.append(write_h5(folder / f"part{i}.h5", start, n, layout=layout))
        start += n
    lst = folder / "train.txt"
    lst.write_text("\n".join(p.name for p in paths) + "\n")
    return lst, paths


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def rewrite_in_place(path: Path) -> None:
    """Overwrite the second half of the file with other bytes, keeping its size and mtime."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(b"\x5a" * (st.st_size - st.st_size // 2))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def make_unreadable(path: Path) -> None:
    path.chmod(0)


def delete(path: Path) -> None:
    os.remove(path)


def rename_over(path: Path) -> None:
    """Replace the file by renaming another one over it (its rows are other samples)."""
    other = path.with_suffix(".new")
    write_h5(other, 10_000, 400)
    os.replace(other, path)


CHANGES = {"truncated": truncate, "rewritten": rewrite_in_place, "unreadable": make_unreadable}
HARMLESS = {"deleted": delete, "renamed over": rename_over}


# --- local files, mid-epoch --------------------------------------------------------------------


def expected_path(layout: str, mmap: bool | str) -> str:
    """The read path of ``data``: the default ("auto") maps local contiguous files."""
    return "mmap" if layout == "contiguous" and mmap == "auto" else LAYOUTS[layout]


@pytest.mark.parametrize("mmap", ["auto", False])
@pytest.mark.parametrize("layout", FAST_AND_FALLBACK)
@pytest.mark.parametrize("fault", sorted(CHANGES))
async def test_file_changed_mid_epoch_is_a_read_error(
    tmp_path: Path, layout: str, fault: str, mmap: bool | str
) -> None:
    if layout != "contiguous" and mmap is False:
        pytest.skip("copied either way")
    lst, paths = write_big(tmp_path, layout)
    victim = paths[2]
    before = await asnapshot()
    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20, mmap=mmap) as layer:  # type: ignore[arg-type]
        assert layer.stats.read_paths["data"] == expected_path(layout, mmap)
        got, err = await epoch_until_error(
            layer, lambda i: CHANGES[fault](victim) if i == 1 else None
        )
    await aassert_released(before)
    assert isinstance(err, ReadError), err
    assert 10 <= len(check_prefix(got, 10)) <= 800  # the two intact files at most, all correct
    # Mapped, whichever sees the change first names it: the file's fingerprint, checked after
    # every gather, or its read lease, broken when the file is opened for writing.
    mapped = expected_path(layout, mmap) == "mmap"
    if mapped and "while it was mapped" in str(err):
        check_message(err, victim, "opened the file for writing or truncated it")
    else:
        check_message(err, victim, "after the source was opened")


@pytest.mark.parametrize("layout", FAST_AND_FALLBACK)
@pytest.mark.parametrize("fault", sorted(HARMLESS))
async def test_file_deleted_or_renamed_over_is_read_from_the_open_file(
    tmp_path: Path, layout: str, fault: str
) -> None:
    lst, paths = write_big(tmp_path, layout)
    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20) as layer:
        got, err = await epoch_until_error(
            layer, lambda i: HARMLESS[fault](paths[2]) if i == 1 else None
        )
        assert err is None
        check_epoch(got, 1200, 10, 0)
        again, err = await epoch_until_error(layer)  # still the file opened first
        assert err is None
        check_epoch(again, 1200, 10, 1)


@pytest.mark.both_backends
@pytest.mark.parametrize("mmap", ["auto", False])
async def test_every_batch_before_a_read_error_is_delivered(
    tmp_path: Path, mmap: bool | str
) -> None:
    lst, paths = write_big(tmp_path)

    async def slow(i: int) -> None:
        if i == 1:
            truncate(paths[2])

    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20, mmap=mmap) as layer:  # type: ignore[arg-type]
        got: list[Batch] = []
        with pytest.raises(ReadError) as info:
            async for b in layer:
                got.append(b)
                await slow(len(got))
                await anyio.sleep(0.002)  # keeps the pipeline's item buffer full
    # Rows 0-799 come from the two intact files; each chunk is read whole before it is cut.
    # Mapped, every gather checks every file (and waits for the leases of all): the batches
    # gathered once the third changed are not delivered either.
    if mmap is False:
        assert len(check_prefix(got, 10)) == 800
    else:
        assert 10 <= len(check_prefix(got, 10)) <= 800
    check_message(info.value, paths[2], "truncated")


@pytest.mark.both_backends
async def test_epoch_after_a_read_error_fails_again_naming_the_file(tmp_path: Path) -> None:
    lst, paths = write_big(tmp_path)
    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20) as layer:
        _, err = await epoch_until_error(layer, lambda i: truncate(paths[2]) if i == 1 else None)
        assert isinstance(err, ReadError)
        got, err = await epoch_until_error(layer)
    assert isinstance(err, ReadError)
    check_message(err, paths[2])
    for b in got:
        check_batch(b, 10)


def test_sync_facade_file_truncated_mid_epoch(tmp_path: Path) -> None:
    lst, paths = write_big(tmp_path, "gzip")
    got: list[Batch] = []
    with HDF5DataLayer(lst, batch_size=10, chunk_size=20) as layer:
        with pytest.raises(ReadError) as info:
            for b in layer:
                got.append(b)
                if len(got) == 1:
                    truncate(paths[2])
    assert 10 <= len(check_prefix(got, 10)) <= 800
    check_message(info.value, paths[2], "truncated")


# --- local files, before open ------------------------------------------------------------------


async def open_fails(source: Any, exc_type: type[DataLayerError], **kw: Any) -> DataLayerError:
    before = await asnapshot()
    with pytest.raises(exc_type) as info:
        async with AsyncHDF5DataLayer(source, batch_size=10, **kw):
            pytest.fail("the layer opened")
    await aassert_released(before)
    return info.value


@pytest.mark.parametrize("layout", FAST_AND_FALLBACK)
async def test_file_truncated_before_open(tmp_path: Path, layout: str) -> None:
    lst, paths = write_big(tmp_path, layout)
    truncate(paths[1])
    err = await open_fails(lst, SourceError)
    check_message(err, paths[1])


async def test_file_missing_before_open(tmp_path: Path) -> None:
    lst, paths = write_big(tmp_path)
    os.remove(paths[1])
    check_message(await open_fails(lst, SourceError), paths[1], "does not exist")


async def test_file_not_hdf5_before_open(tmp_path: Path) -> None:
    lst, paths = write_big(tmp_path)
    paths[1].write_bytes(b"not an HDF5 file\n" * 100)
    check_message(await open_fails(lst, SourceError), paths[1], "not an HDF5 file")


def test_file_unreadable_before_open(tmp_path: Path) -> None:
    """Permission denied, for real, in a child process: as root (which reads anything) without
    the capabilities that let it ignore file permissions, dropped with ``setpriv``."""
    lst, paths = write_big(tmp_path)
    paths[1].chmod(0)
    code = textwrap.dedent(
        f"""
        import anyio
        from asynchdf5 import AsyncHDF5DataLayer, SourceError
        async def main():
            try:
                async with AsyncHDF5DataLayer({str(lst)!r}, batch_size=10):
                    print("OPENED")
            except SourceError as exc:
                print("SourceError:", exc)
        anyio.run(main)
        """
    )
    command = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: root reads any file")
        drop = "-dac_override,-dac_read_search"
        command = [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", *command]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SourceError:"), out.stdout + out.stderr
    check_message(SourceError(out.stdout), paths[1], "permission denied")


# Not lz4: its small chunks here are stored raw (nothing to check; test_read checks its framing).
@pytest.mark.parametrize(
    "layout", ["gzip", "fletcher32", "gzip-split", "fletcher32-split", "bzip2"]
)
async def test_corrupt_chunk_is_a_read_error_after_the_complete_batches(
    tmp_path: Path, layout: str
) -> None:
    """Bit rot: a chunk's bytes damaged before the layer opens (so the file's metadata is as
    catalogued); the codec (gzip, bzip2) or checksum (fletcher32) catches it when the chunk is
    read."""
    lst, paths = write_big(tmp_path, layout)
    victim = paths[2]
    with h5py.File(victim) as f:
        info = f["data"].id.get_chunk_info_by_coord((80, 0))  # a chunk of rows 80:88
    with open(victim, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(b"\xa5\x5a\xa5\x5a")
    before = await asnapshot()
    async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20) as layer:
        assert layer.stats.read_paths["data"] == LAYOUTS[layout]
        got, err = await epoch_until_error(layer)
    await aassert_released(before)
    assert isinstance(err, ReadError), err
    check_message(err, victim, "'data'", "rows 80:")
    assert len(check_prefix(got, 10)) == 880  # every row before the corrupt chunk's batch
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__  # type: ignore[assignment]
    assert not isinstance(cause, DataLayerError) or "checksum" in str(cause).lower()


# --- external links ----------------------------------------------------------------------------


def write_linked(folder: Path, layout: str) -> tuple[Path, Path]:
    """``link.h5`` whose ``data`` is an external link to ``data`` in ``target.h5`` (with other
    rows before it, so a read at the wrong offset shows)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = write_h5(folder / "target.h5", 0, 500, layout=layout, padding=np.arange(999.0))
    link = folder / "link.h5"
    with h5py.File(link, "w") as f:
        f.create_dataset("filler", data=np.full(4096, -1.0))
        f["data"] = h5py.ExternalLink(target.name, "/data")
        f.create_dataset("label", data=rows(0, 500)["label"])
    return link, target


@pytest.mark.parametrize("layout", ["contiguous", "gzip", "gzip-split", "scaleoffset"])
async def test_external_link_top_is_read_from_its_target(tmp_path: Path, layout: str) -> None:
    link, _ = write_linked(tmp_path, layout)
    async with AsyncHDF5DataLayer([link], batch_size=50, shuffle=True, seed=1) as layer:
        assert layer.stats.read_paths["data"] == LAYOUTS[layout]
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 500, 50, 0)


async def test_external_link_target_missing_is_a_source_error(tmp_path: Path) -> None:
    link, target = write_linked(tmp_path, "contiguous")
    os.remove(target)
    err = await open_fails([link], SourceError)
    check_message(err, link, "'data'", target.name)


async def test_external_link_target_rewritten_mid_epoch(tmp_path: Path) -> None:
    link, target = write_linked(tmp_path, "contiguous")
    async with AsyncHDF5DataLayer([link], batch_size=10, chunk_size=20) as layer:
        got, err = await epoch_until_error(
            layer, lambda i: rewrite_in_place(target) if i == 1 else None
        )
    assert isinstance(err, ReadError)
    check_message(err, target, "'data'")
    check_prefix(got, 10)


# --- external raw storage ----------------------------------------------------------------------


def write_external(folder: Path, *, convert: bool = False) -> tuple[Path, list[Path]]:
    """``ext.h5`` whose ``data`` (500 rows) is stored in two raw files, the second from an offset.

    ``convert``: store it as 3-byte integers, which HDF5 converts (the h5py read path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = rows(0, 500)["data"]
    half = 250 * data[0].nbytes
    raw = [folder / "a.bin", folder / "b.bin"]
    raw[0].write_bytes(data[:250].tobytes())
    raw[1].write_bytes(b"\x00" * 64 + data[250:].tobytes())
    path = folder / "ext.h5"
    with h5py.File(path, "w") as f:
        if convert:
            # The same values as 4-byte little-endian integers with 24 bits of precision.
            ints = data.astype(np.int32)
            raw[0].write_bytes(ints[:250].tobytes())
            raw[1].write_bytes(b"\x00" * 64 + ints[250:].tobytes())
            t = h5py.h5t.STD_I32LE.copy()
            t.set_precision(24)
            space = h5py.h5s.create_simple(data.shape)
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_external(str(raw[0]).encode(), 0, half)
            dcpl.set_external(str(raw[1]).encode(), 64, half)
            h5py.h5d.create(f.id, b"data", t, space, dcpl=dcpl)
        else:
            f.create_dataset(
                "data",
                shape=data.shape,
                dtype=data.dtype,
                external=[(str(raw[0]), 0, half), (str(raw[1]), 64, half)],
            )
        f.create_dataset("label", data=rows(0, 500)["label"])
    return path, raw


@pytest.mark.parametrize("convert", [False, True], ids=["pread", "h5py"])
async def test_external_storage_is_read(tmp_path: Path, convert: bool) -> None:
    path, _ = write_external(tmp_path, convert=convert)
    async with AsyncHDF5DataLayer([path], batch_size=50, shuffle=True, seed=2) as layer:
        assert layer.stats.read_paths["data"] == ("h5py" if convert else "pread")
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 500, 50, 0)


@pytest.mark.parametrize("damage", ["missing", "short"])
async def test_external_storage_missing_or_short_before_open(tmp_path: Path, damage: str) -> None:
    path, raw = write_external(tmp_path)
    if damage == "missing":
        os.remove(raw[1])
    else:
        os.truncate(raw[1], 1000)
    err = await open_fails([path], SourceError)
    check_message(err, path, "'data'", raw[1], "zeros")


@pytest.mark.parametrize("convert", [False, True], ids=["pread", "h5py"])
async def test_external_storage_truncated_mid_epoch(tmp_path: Path, convert: bool) -> None:
    path, raw = write_external(tmp_path, convert=convert)
    async with AsyncHDF5DataLayer([path], batch_size=10, chunk_size=20) as layer:
        got, err = await epoch_until_error(layer, lambda i: truncate(raw[1]) if i == 1 else None)
    assert isinstance(err, ReadError)
    check_message(err, raw[1])
    check_prefix(got, 10)


async def test_external_storage_deleted_mid_epoch(tmp_path: Path) -> None:
    """On the fast path the layer reads the raw file it opened; on the h5py path HDF5 opens it
    by name each time and would read zeros: a ReadError."""
    for convert in (False, True):
        path, raw = write_external(tmp_path / str(convert), convert=convert)
        victim = raw[1]

        def act(i: int, victim: Path = victim) -> None:
            if i == 1:
                delete(victim)

        async with AsyncHDF5DataLayer([path], batch_size=10, chunk_size=20) as layer:
            got, err = await epoch_until_error(layer, act)
        if convert:
            assert isinstance(err, ReadError)
            check_message(err, raw[1], "deleted")
            check_prefix(got, 10)
        else:
            assert err is None
            check_epoch(got, 500, 10, 0)


# --- virtual datasets --------------------------------------------------------------------------


def write_virtual(folder: Path) -> tuple[Path, list[Path]]:
    """``vds.h5`` whose ``data`` and ``label`` (1200 rows) map three source files of 400."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = []
    for i in range(3):
        sources.append(write_h5(folder / f"src{i}.h5", 400 * i, 400))
    path = folder / "vds.h5"
    with h5py.File(path, "w") as f:
        for name, example in rows(0, 1).items():
            layout = h5py.VirtualLayout(shape=(1200, *example.shape[1:]), dtype=example.dtype)
            for i, src in enumerate(sources):
                vsource = h5py.VirtualSource(src.name, name, shape=(400, *example.shape[1:]))
                layout[400 * i : 400 * (i + 1)] = vsource
            f.create_virtual_dataset(name, layout, fillvalue=-7)
    return path, sources


async def test_virtual_dataset_is_read(tmp_path: Path) -> None:
    path, _ = write_virtual(tmp_path)
    async with AsyncHDF5DataLayer([path], batch_size=40, shuffle=True, seed=3) as layer:
        assert layer.stats.read_paths == {"data": "h5py", "label": "h5py"}
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 1200, 40, 0)


@pytest.mark.parametrize("damage", ["missing", "no dataset", "short"])
async def test_virtual_source_missing_or_short_before_open(tmp_path: Path, damage: str) -> None:
    path, sources = write_virtual(tmp_path)
    if damage == "missing":
        os.remove(sources[1])
    elif damage == "no dataset":
        with h5py.File(sources[1], "a") as f:
            del f["data"]
    else:
        write_h5(sources[1], 400, 300)
    err = await open_fails([path], SourceError)
    check_message(err, path, "virtual", sources[1].name, "fill values")


@pytest.mark.parametrize("fault", ["deleted", "truncated", "renamed over"])
async def test_virtual_source_changed_mid_epoch(tmp_path: Path, fault: str) -> None:
    path, sources = write_virtual(tmp_path)
    act = {"deleted": delete, "truncated": truncate, "renamed over": rename_over}[fault]
    async with AsyncHDF5DataLayer([path], batch_size=10, chunk_size=20) as layer:
        got, err = await epoch_until_error(layer, lambda i: act(sources[2]) if i == 1 else None)
    assert isinstance(err, ReadError), err
    check_message(err, sources[2])
    assert len(check_prefix(got, 10)) <= 800


# --- storage details the fast paths must honour ------------------------------------------------


def _hdf5_lib() -> Any:
    """The libhdf5 h5py is linked to (not another one in the process, such as PyTables')."""
    return ctypes.CDLL(h5py.defs.__file__)


@pytest.mark.parametrize(("shape", "chunk"), [((2,), (100, 2)), ((5,), (100, 3))])
async def test_partial_chunks_stored_unfiltered_are_read(
    tmp_path: Path, shape: tuple[int, ...], chunk: tuple[int, int]
) -> None:
    """``H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS``: the last, partial gzip chunk is stored raw; with
    chunks that split the samples, so is every chunk of the last band and of the last column."""
    lib = _hdf5_lib()
    lib.H5Pset_chunk_opts.argtypes = [ctypes.c_int64, ctypes.c_uint]
    data = rows(0, 1003, shape)
    path = tmp_path / "partial.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(chunk)
        dcpl.set_deflate(4)
        assert lib.H5Pset_chunk_opts(dcpl.id, 0x0002) >= 0
        space = h5py.h5s.create_simple(data["data"].shape)
        dsid = h5py.h5d.create(f.id, b"data", h5py.h5t.IEEE_F32LE, space, dcpl=dcpl)
        h5py.Dataset(dsid)[...] = data["data"]
        f.create_dataset("label", data=data["label"], chunks=(100,), compression="gzip")
    with h5py.File(path) as f:  # the last chunk really is stored raw
        last = f["data"].id.get_chunk_info_by_coord((1000, 0))
        assert last.size == 100 * chunk[1] * 4 and last.filter_mask == 0
    async with AsyncHDF5DataLayer([path], batch_size=64, shuffle=True, seed=2) as layer:
        assert layer.stats.read_paths["data"] == "chunks"
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 1003, 64, 0)
    for b in got:  # every column, the raw edge ones included
        np.testing.assert_array_equal(b["data"], data["data"][b.indices])


async def test_type_stored_with_other_precision_is_converted(tmp_path: Path) -> None:
    """A label stored as 20-bit integers in 4 bytes: its raw bytes are not int32 values (the
    fast path read -5 as 1048571); HDF5 converts them."""
    path = tmp_path / "precision.h5"
    with h5py.File(path, "w") as f:
        t = h5py.h5t.STD_I32LE.copy()
        t.set_precision(20)
        dsid = h5py.h5d.create(f.id, b"label", t, h5py.h5s.create_simple((10,)))
        h5py.Dataset(dsid)[...] = np.arange(10) - 5
        f.create_dataset("data", data=np.arange(10, dtype=np.float32))
    async with AsyncHDF5DataLayer([path], batch_size=10) as layer:
        assert layer.stats.read_paths == {"data": "pread", "label": "h5py"}
        (batch,) = [b async for b in layer]
    np.testing.assert_array_equal(batch["label"], np.arange(10) - 5)


@pytest.mark.parametrize("layout", ["contiguous", "gzip"])
async def test_big_endian_tops_take_the_fast_paths(tmp_path: Path, layout: str) -> None:
    data = rows(0, 300)
    path = tmp_path / "be.h5"
    kw: dict[str, Any] = {"chunks": True, "compression": "gzip"} if layout == "gzip" else {}
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data["data"].astype(">f4"), **kw)
        f.create_dataset("label", data=data["label"].astype(">i8"), **kw)
    async with AsyncHDF5DataLayer([path], batch_size=32, shuffle=True, seed=4) as layer:
        assert set(layer.stats.read_paths.values()) == {LAYOUTS[layout]}
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 300, 32, 0)
    assert got[0]["data"].dtype == np.float32 and got[0]["data"].dtype.isnative


async def test_dangling_soft_link_top_is_a_schema_error(tmp_path: Path) -> None:
    path = write_h5(tmp_path / "soft.h5", 0, 10)
    with h5py.File(path, "a") as f:
        f["alias"] = h5py.SoftLink("/nowhere")
    with pytest.raises(SchemaError) as info:
        async with AsyncHDF5DataLayer([path], batch_size=5, tops=("alias", "label")):
            pass
    check_message(info.value, path, "'alias'")


async def test_copied_folder_reads_the_same(tmp_path: Path) -> None:
    """Sanity check of the fixtures above: a plain copy of the files reads correctly."""
    write_big(tmp_path / "a", "fletcher32")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    async with AsyncHDF5DataLayer(tmp_path / "b" / "train.txt", batch_size=100) as layer:
        got, err = await epoch_until_error(layer)
    assert err is None
    check_epoch(got, 1200, 100, 0)
