"""``mmap=True``: rows served from the mapped file give the batches the copying reader gives.

Real files, the whole pipeline, every test under a deadline. Checked: the same batches (indices
and rows) as ``mmap=False`` for the same seed, streaming and resident, with pages kept mapped
between epochs and with each chunk unmapped after use (the data set larger than the bound); the
sources it does not apply to are read as usual and say why; a file changed before a chunk is
served is a named :class:`ReadError` before any of its batches; the mapped pages stay within the
chunks in flight when not kept; nothing stays mapped, open or running after the layer closes; a
file truncated or opened for writing while its chunk is served waits for the layer's read lease
and ends the run with a ReadError; and where no lease is granted, the documented hazard (a
truncation then ends the process with SIGBUS) is what happens, in a child process.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import anyio
import h5py
import numpy as np
import pytest

import asynchdf5._read._choice as choice
import asynchdf5._read._mapped as mapped
import asynchdf5._read._maps as maps
from asynchdf5 import AsyncHDF5DataLayer, ConfigurationError, HDF5DataLayer, ReadError
from asynchdf5._read._lease import Lease
from asynchdf5._read._maps import ChunkRows

from ._files import check_epoch, check_exactly_once, check_message, rows, write_h5, write_list
from ._leaks import aassert_released, asnapshot
from .test_faults import rewrite_in_place, truncate, write_linked

pytestmark = pytest.mark.anyio

N = 5_003  # rows: not a multiple of the batch, the chunk or a page
ROW_BYTES = 2 * 4 + 8


@pytest.fixture
def no_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Map without a read lease, as where Linux grants none: the file's fingerprint checks are
    then what catches a change (with a lease, a writer waits for the gathers in flight)."""
    monkeypatch.setattr(Lease, "take", classmethod(lambda cls, file: "not in this test"))


def mappings(path: Path, *, collect: bool = False) -> list[int]:
    """The resident kilobytes of each mapping of ``path`` in this process (``collect``: after
    the garbage collector has freed what only reference cycles hold, such as the frames of a
    cancelled task): the pages of its address range present in the page tables, read from
    ``/proc/self/pagemap`` (bit 63 of each page's entry), which is what smaps calls ``Rss``.
    Reading smaps walks every mapping of the process (those of torch's libraries included) and
    takes a hundred times as long; the mappings of ``path`` are found in ``/proc/self/maps``."""
    if collect:
        gc.collect()
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == str(path):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    page = os.sysconf("SC_PAGE_SIZE")
    out = []
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        for start, end in ranges:
            f.seek(start // page * 8)
            entries = np.frombuffer(f.read((end - start) // page * 8), np.uint64)
            present = int(np.count_nonzero(entries >> np.uint64(63)))
            out.append(present * page // 1024)
    return out


async def batches(path: Path, epochs: int = 2, **kw: Any) -> tuple[list[list[Any]], Any]:
    out = []
    async with AsyncHDF5DataLayer(path, batch_size=kw.pop("batch_size", 64), **kw) as layer:
        for _ in range(epochs):
            out.append([b async for b in layer])
        stats = layer.stats
    return out, stats


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    ("chunk_size", "cache_rows", "kept"),
    [
        (1024, 2048, True),  # streaming: chunks smaller than the data set
        (1024, 2048, False),  # streaming, each chunk unmapped after use
        (2**20, None, True),  # the whole data set one chunk (resident when copied)
        (2**20, None, False),
    ],
)
async def test_the_same_batches_as_the_copying_reader(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shuffle: bool,
    chunk_size: int,
    cache_rows: int | None,
    kept: bool,
) -> None:
    if not kept:
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = write_h5(tmp_path / "one.h5", 0, N)
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=3, chunk_size=chunk_size, epochs=3)
    if cache_rows is not None:
        kw["cache_bytes"] = cache_rows * ROW_BYTES
    before = await asnapshot()
    with anyio.fail_after(60):
        copied, copied_stats = await batches(path, mmap=False, **kw)
        served, stats = await batches(path, **kw)  # the default, "auto", maps this file
    await aassert_released(before)
    assert copied_stats.read_paths == {"data": "pread", "label": "pread"}
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}
    for note in stats.read_notes.values():  # tmp_path is on a local file system
        assert note.startswith("mapped: ") and note.endswith(", read lease held"), note
    if kept:  # every row mapped (read) once, never again
        assert stats.bytes_read == N * ROW_BYTES
    else:  # read again every epoch
        assert stats.bytes_read >= 2 * N * ROW_BYTES
    for epoch, (mine, theirs) in enumerate(zip(served, copied, strict=True)):
        check_epoch(mine, N, 64, epoch)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a["data"], b["data"])
            np.testing.assert_array_equal(a["label"], b["label"])
    assert mappings(path, collect=True) == []  # unmapped once closed


def _files(folder: Path, sizes: list[int], layout: str = "contiguous") -> Path:
    """A source list of files with ``sizes`` rows (some may have none), rows numbered across."""
    start, names = 0, []
    for i, n in enumerate(sizes):
        # h5py chunks no dataset of 0 rows: such a file is contiguous (and never mapped)
        write_h5(folder / f"part{i}.h5", start, n, layout=layout if n else "contiguous")
        names.append(f"part{i}.h5")
        start += n
    (folder / "list.txt").write_text("\n".join(names) + "\n")
    return folder / "list.txt"


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("kept", [True, False])
async def test_several_files_are_mapped_and_give_the_copying_readers_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool, kept: bool, layout: str
) -> None:
    """Four files (one without rows), chunks and batches across their boundaries: mapped, a
    lease on each, the same batches as copied; nothing mapped or open once closed. Stored
    contiguously, or in chunks of 8 whole rows (each file's last one partial)."""
    if not kept:
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    source = _files(tmp_path, [1700, 0, 2003, 1300], layout)
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=5, chunk_size=1024, epochs=2)
    kw["cache_bytes"] = 2048 * ROW_BYTES
    before = await asnapshot()
    with anyio.fail_after(60):
        copied, _ = await batches(source, mmap=False, **kw)
        served, stats = await batches(source, **kw)
    await aassert_released(before)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}
    assert stats.read_notes["data"].startswith("mapped: 3 files on local file system"), stats
    assert stats.read_notes["data"].endswith("read leases held")
    for epoch, (mine, theirs) in enumerate(zip(served, copied, strict=True)):
        check_epoch(mine, N, 64, epoch)
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a["data"], b["data"])
            np.testing.assert_array_equal(a["label"], b["label"])
    for i in range(4):
        assert mappings(tmp_path / f"part{i}.h5", collect=True) == []


async def test_a_source_of_more_files_than_the_bound_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mapped file holds a lease's descriptor: past the bound, the source is copied, and
    the notes say why."""
    monkeypatch.setattr(choice, "max_files", lambda: 2)
    source = _files(tmp_path, [2000, 2000, 1003])
    with anyio.fail_after(30):
        got, stats = await batches(source, epochs=1, shuffle=True, seed=0, chunk_size=1000)
    check_epoch(got[0], N, 64, 0)
    assert stats.read_paths == {"data": "pread", "label": "pread"}
    assert stats.read_notes["data"].startswith("copied: 3 files, more than the 2 mapped at most")


_BOUND = """
import resource, sys
from asynchdf5._read._choice import max_files
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for soft in (64, 200, 1024, 4096):
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
    print(min(soft, hard), max_files())
"""


def test_the_bound_is_an_eighth_of_the_descriptor_limit_and_at_most_64() -> None:
    proc = _child(_BOUND)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        soft, bound = map(int, line.split())
        assert bound == max(1, min(64, soft // 8)), proc.stdout


@pytest.mark.parametrize("mode", [True, "auto"])
async def test_one_file_of_several_without_a_lease(tmp_path: Path, mode: bool | str) -> None:
    """One of three files is open for writing: "auto" copies the source and names the file;
    ``mmap=True`` maps it, the notes naming the file not guarded."""
    source = _files(tmp_path, [2000, 2000, 1003])
    with open(tmp_path / "part1.h5", "r+b"), anyio.fail_after(30):
        got, stats = await batches(source, epochs=1, shuffle=True, seed=0, mmap=mode)
    check_epoch(got[0], N, 64, 0)
    note = stats.read_notes["data"]
    if mode is True:
        assert stats.read_paths["data"] == "mmap"
        assert note.startswith("mapped, not guarded by a lease: the file is open for writing")
    else:
        assert stats.read_paths["data"] == "pread"
        assert note.startswith("copied: no read lease: the file is open for writing")
    assert str(tmp_path / "part1.h5") in note


def test_sync_facade(tmp_path: Path) -> None:
    path = write_h5(tmp_path / "one.h5", 0, N)
    with HDF5DataLayer(
        path, batch_size=100, shuffle=True, seed=1, chunk_size=1000, mmap=True
    ) as layer:
        for epoch in range(2):
            check_epoch(list(layer), N, 100, epoch)
        assert layer.stats.read_paths["data"] == "mmap"
    assert mappings(path, collect=True) == []


def _big_endian(folder: Path) -> Path:
    path = write_h5(folder / "be.h5", 0, N)
    with h5py.File(path, "r+") as f:
        data = f["data"][:]
        del f["data"]
        f.create_dataset("data", data=data.astype(">f4"))
    return path


def _compact(folder: Path) -> Path:
    """A contiguous-looking top read through h5py: the compact layout (data in the header)."""
    path = write_h5(folder / "compact.h5", 0, N)
    with h5py.File(path, "r+") as f:
        data = f["data"][:]
        del f["data"]
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_layout(h5py.h5d.COMPACT)
        space = h5py.h5s.create_simple(data.shape)
        dset = h5py.h5d.create(f.id, b"data", h5py.h5t.py_create(data.dtype), space, plist)
        dset.write(h5py.h5s.ALL, h5py.h5s.ALL, data)
    return path


def _split(folder: Path) -> Path:
    """Unfiltered chunks of 8 rows and one column: each holds part of its samples."""
    path = write_h5(folder / "split.h5", 0, N)
    with h5py.File(path, "r+") as f:
        data = f["data"][:]
        del f["data"]
        f.create_dataset("data", data=data, chunks=(8, 1))
    return path


def _padded(folder: Path) -> Path:
    """Unfiltered chunks of 8 rows of 4 columns over samples of 2 (``maxshape`` lets a chunk
    be wider than the data): every chunk holds whole samples and padding between them."""
    path = write_h5(folder / "padded.h5", 0, N)
    with h5py.File(path, "r+") as f:
        data = f["data"][:]
        del f["data"]
        f.create_dataset("data", data=data, chunks=(8, 4), maxshape=(None, None))
    return path


REFUSED: dict[str, tuple[Callable[[Path], Path], str]] = {
    "gzip": (
        lambda d: write_h5(d / "z.h5", 0, N, layout="gzip"),
        "is stored chunked (8, 2), filtered: mapping needs contiguous storage or unfiltered chunks",
    ),
    "chunks that split samples": (
        _split,
        "is stored chunked (8, 1), chunks that split its samples: mapping needs chunks of whole",
    ),
    "chunks wider than samples": (
        _padded,
        "is stored chunked (8, 4), chunks wider than its samples (padded): mapping needs chunks",
    ),
    "other byte order": (_big_endian, "stored in the other byte order"),
    "compact": (_compact, "is read through h5py (compact layout): mapping needs contiguous"),
}


@pytest.mark.parametrize("mode", [True, "auto"])
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_where_it_does_not_apply_the_layer_reads_as_usual_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str, mode: bool | str
) -> None:
    """Copied, with the reason in ``read_notes``; a warning only where mapping was asked for."""
    make, reason = REFUSED[case]
    source = make(tmp_path)
    with caplog.at_level(logging.INFO, "asynchdf5"), anyio.fail_after(30):
        got, stats = await batches(source, shuffle=True, seed=0, chunk_size=1000, mmap=mode)
    for epoch, epoch_batches in enumerate(got):
        check_epoch(epoch_batches, N, 64, epoch)
    assert "mmap" not in " ".join(stats.read_paths.values())
    for top in ("data", "label"):
        assert "copied: " in stats.read_notes[top] and reason in stats.read_notes[top]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("mmap=True does not apply" in r.getMessage() for r in warned) == (mode is True)


@pytest.mark.parametrize("mode", [True, "auto"])
async def test_tops_in_two_files_are_copied(tmp_path: Path, mode: bool | str) -> None:
    """A top reached through an external link is stored in another file: one lease guards one
    file, so the source is copied (``mmap=True`` mapped it, the linked file unguarded)."""
    link, target = write_linked(tmp_path, "contiguous")
    with anyio.fail_after(30):
        got, stats = await batches(link, epochs=1, shuffle=True, seed=0, mmap=mode)
    check_epoch(got[0], 500, 64, 0)
    assert stats.read_paths == {"data": "pread", "label": "pread"}
    assert f"copied: top 'data' is stored in another file ({target})" in stats.read_notes["label"]


async def test_auto_copies_a_data_set_larger_than_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Read from the disk every epoch anyway: the copying reader streams it (``mmap=True``
    maps it all the same, and warns that its batches fault their rows in from the disk)."""
    import asynchdf5._hdf5

    monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda *a: N * ROW_BYTES - 1)
    path = write_h5(tmp_path / "one.h5", 0, N)
    with anyio.fail_after(30):
        got, stats = await batches(path, epochs=1, shuffle=True, seed=0, chunk_size=1000)
        assert not [r for r in caplog.records if "mmap=True" in r.getMessage()]
        caplog.set_level(logging.WARNING, logger="asynchdf5")
        forced_got, forced = await batches(path, epochs=1, chunk_size=1000, mmap=True)
    check_epoch(forced_got[0], N, 64, 0)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(
        m.startswith("mmap=True: the data set (0.0 GiB) is larger than the memory this process")
        and 'mmap="auto" streams it' in m
        for m in warned
    ), warned
    assert "is larger than the memory this process may use" in forced.read_notes["data"]
    check_epoch(got[0], N, 64, 0)
    assert stats.read_paths == {"data": "pread", "label": "pread"}
    assert (
        "copied: the data set (0.0 GiB) is larger than the memory this process may use"
        in (stats.read_notes["data"])
    )
    assert forced.read_paths["data"] == "mmap"


@pytest.mark.parametrize("value", ["yes", "AUTO", 1, None])
def test_the_property_is_true_false_or_auto(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigurationError, match='mmap must be True, False or "auto"'):
        AsyncHDF5DataLayer(tmp_path / "x.h5", batch_size=1, mmap=value)  # type: ignore[arg-type]


async def test_mmap_false_copies_and_says_nothing(tmp_path: Path) -> None:
    path = write_h5(tmp_path / "one.h5", 0, N)
    with anyio.fail_after(30):
        got, stats = await batches(path, shuffle=True, seed=0, chunk_size=1000, mmap=False)
    check_epoch(got[0], N, 64, 0)
    assert stats.read_paths == {"data": "pread", "label": "pread"}
    assert stats.read_notes == {}


# --- files that change --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"), [(truncate, "truncated"), (rewrite_in_place, "changed")]
)
async def test_a_file_changed_before_a_chunk_is_served_is_a_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Any, words: str
) -> None:
    """Changed just before the first chunk is made ready (deterministic, and no gather can
    touch a page of the changed file, so the test process cannot meet a SIGBUS): the epoch
    fails with a ReadError naming the file, the top and the rows, before any batch; and the
    failed chunk is not left among those in use (chunks are unmapped after use here)."""
    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = write_h5(tmp_path / "one.h5", 0, N)
    prepare = mapped.MappedReader._prepare
    readers: list[mapped.MappedReader] = []

    def change_first(self: mapped.MappedReader, ranges: list[tuple[int, int]]) -> int:
        if not readers:
            readers.append(self)
            change(path)
        return prepare(self, ranges)

    monkeypatch.setattr(mapped.MappedReader, "_prepare", change_first)
    before = await asnapshot()
    got = []
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=64, chunk_size=1000, shuffle=True, seed=0, mmap=True
        ) as layer:
            async for b in layer:
                got.append(b)
    await aassert_released(before)
    assert got == []
    check_message(info.value, path, words, "top '", "rows ")
    assert not readers[0]._live  # given back: the failed read, and any read after it
    assert mappings(path, collect=True) == []


@pytest.mark.parametrize(
    ("victim", "words"),
    [
        (1, ["part1.h5", "top 'data', 'label', rows 1000:1500:", "list.txt, line 2"]),
        (2, ["part2.h5", "while reading rows 0:1500 of other files", "list.txt, line 3"]),
    ],
)
async def test_with_several_mapped_files_an_error_names_the_changed_files_own_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: int, words: list[str]
) -> None:
    """Issue 39, item 11: three mapped files of 1,000 rows, a first chunk of rows 0:1500 (part0
    and half of part1). A file changed before that chunk is made ready is named with its own
    rows among them (part1: 1000:1500), or, holding none of them (part2), with the rows being
    read said to be other files': never rows 0:1500 as if they were part2's."""
    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    source = _files(tmp_path, [1000, 1000, 1000])
    prepare = mapped.MappedReader._prepare
    changed: list[bool] = []

    def change_first(self: mapped.MappedReader, ranges: list[tuple[int, int]]) -> int:
        if not changed:
            changed.append(True)
            truncate(tmp_path / f"part{victim}.h5")
        return prepare(self, ranges)

    monkeypatch.setattr(mapped.MappedReader, "_prepare", change_first)
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(source, batch_size=100, chunk_size=1500, mmap=True) as layer:
            assert layer.stats.read_paths["data"] == "mmap"
            async for _ in layer:
                pass
    check_message(info.value, "truncated", *words)
    assert "rows 0:1500:" not in str(info.value)


@pytest.mark.parametrize("stored", ["contiguous", "chunked"])
@pytest.mark.parametrize("chunk_size", [1000, 2**20])  # streaming; the whole set one chunk
async def test_a_file_rewritten_while_served_is_a_read_error_and_no_changed_row_is_yielded(
    tmp_path: Path, chunk_size: int, no_lease: None, stored: str
) -> None:
    """Rewritten in place (size and modification time restored) after the first batch: the
    mapped pages show the new bytes at once, so the rows gathered after it would be wrong
    (those gathered and checked before it are right, and may finish the epoch).
    Each gathered group is checked against the file's fingerprint before it is handed on:
    a ReadError, and every batch yielded before it is correct. Stored contiguously, or in
    chunks of whole rows (mapped as well)."""
    path = tmp_path / "one.h5"
    if stored == "chunked":
        _chunked(path, "maxshape")
    else:
        write_h5(path, 0, N)
    before = await asnapshot()
    got: list[Any] = []
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=16, chunk_size=chunk_size, shuffle=True, seed=0, mmap=True
        ) as layer:
            assert layer.stats.read_paths == {"data": "mmap", "label": "mmap"}
            for _ in range(2):  # the groups gathered before the change may end the epoch
                async for b in layer:
                    got.append(b)
                    if len(got) == 1:
                        rewrite_in_place(path)
    await aassert_released(before)
    assert 1 <= len(got) < 2 * N // 16
    for b in got:
        np.testing.assert_array_equal(b["label"], b.indices)
        np.testing.assert_array_equal(b["data"][:, 0], b.indices * 10)
    check_message(info.value, path, "top '", "rows ")  # issue 30 item 10
    # "modified" when checked between the write and the restored modification time.
    assert "changed" in str(info.value) or "modified" in str(info.value), info.value


async def test_rows_carried_into_the_next_chunk_are_checked_when_carried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_lease: None
) -> None:
    """A batch that straddles two chunks has its first rows copied out of the first one (a
    carry). Rows rewritten in place (modification time restored) just before that copy, and a
    link to the file made just after it: every later check sees the change time moved *and*
    the link count moved, which a link alone does; so the check at the copy is the one that can
    see the rewrite. A ReadError, and every batch yielded before it correct."""
    import asynchdf5._pipeline as pipeline

    path = write_h5(tmp_path / "one.h5", 0, 300)
    with h5py.File(path, "r") as f:
        offset, row = f["data"].id.get_offset(), f["data"].dtype.itemsize * 2
    from asynchdf5._gather import carry as real

    carried: list[int] = []

    def rewrite_then_carry(spec: Any, tops: Any, ragged: Any = None) -> Any:
        if not carried:
            st = path.stat()
            with open(path, "r+b") as f:  # rows 64-99 (the first chunk's last 36): other bytes
                f.seek(offset + 64 * row)
                f.write(np.full(36 * 2, -1, np.float32).tobytes())
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        try:
            return real(spec, tops, ragged)
        finally:
            if not carried:
                carried.append(spec.rows)
                os.link(path, tmp_path / "backup.h5")

    monkeypatch.setattr(pipeline, "carry", rewrite_then_carry)
    got: list[Any] = []
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=64, chunk_size=100, shuffle=False, mmap=True
        ) as layer:
            async for b in layer:
                got.append(b)
    assert carried == [36]
    # The first batch (rows 0-63) is gathered before the carry fails; the batcher's error may
    # end the run before that group is handed over (seen on trio, 2 runs in 8, also before the
    # lease): never a batch after it.
    assert [b.indices[0] for b in got] in ([], [0])
    for b in got:
        np.testing.assert_array_equal(b["data"][:, 0], b.indices * 10)
    check_message(info.value, path, "top '", "rows ")  # issue 30 item 10
    # "modified" when the first batch's own check ran between the write and the restored
    # modification time (the same race as in the test above).
    assert "changed in place" in str(info.value) or "modified" in str(info.value), info.value


# --- memory --------------------------------------------------------------------------------------


def _big(path: Path, n: int, chunks: int | None = None) -> Path:
    """Two int64 tops of ``n`` rows: ``data`` is ten times the row's index, ``label`` it;
    stored contiguously, or in ``chunks`` of that many rows."""
    with h5py.File(path, "w") as f:
        kw: dict[str, Any] = {} if chunks is None else {"chunks": (chunks,)}
        f.create_dataset("data", data=np.arange(n, dtype=np.int64) * 10, **kw)
        f.create_dataset("label", data=np.arange(n, dtype=np.int64), **kw)
    return path


def _streamed(path: Path, batch_size: int) -> AsyncHDF5DataLayer:
    """Mapped, shuffled, in chunks of 2**18 rows (2 MiB a top), each one block of the file."""
    return AsyncHDF5DataLayer(
        path,
        batch_size=batch_size,
        chunk_size=2**18,
        block_size=2**18,
        shuffle=True,
        seed=0,
        mmap=True,
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the reader is the same on both
@pytest.mark.parametrize("stored", [None, 2**15], ids=["contiguous", "chunked"])
async def test_pages_of_chunks_done_with_are_unmapped_unless_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: int | None
) -> None:
    """A data set of 256 MiB (128 MiB a top) in chunks of 4 MiB: unless kept, the mapped pages
    stay within the chunks in flight; kept (the control), the whole file ends up mapped. One
    epoch each: left mapped, its chunks would map the whole top by its end (the epochs after
    it: ``test_chunks_of_epochs_left_early_are_unmapped_too``). Stored contiguously, or in
    stored chunks of 256 KiB (a plan chunk's rows: the byte spans of 8 of them)."""
    path = _big(tmp_path / "big.h5", 2**24, stored)
    peaks = {}
    for kept, bound in ((False, 0), (True, 2**40)):
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda bound=bound: bound)
        peak = 0
        with anyio.fail_after(60):
            async with _streamed(path, batch_size=2**14) as layer:
                assert layer.stats.read_paths == {"data": "mmap", "label": "mmap"}
                async for i, b in _enumerate(layer):
                    np.testing.assert_array_equal(b["label"], b.indices)
                    np.testing.assert_array_equal(b["data"], b.indices * 10)
                    if i % 8 == 0:  # reading the maps takes about a millisecond
                        peak = max(peak, max(mappings(path)))
                peak = max(peak, max(mappings(path)))  # and at the epoch's end
        peaks[kept] = peak
    # KiB of one top. Not kept: the chunks in flight (2 MiB of a top each, in one or two
    # blocks), and what the kernel maps beside the pages asked for (up to the whole folio of
    # the page cache that holds each end of a block: 2 MiB). In flight: those made ready ahead
    # of the batcher, the batcher's, and those the groups cut and not yet taken reach (groups
    # of two chunks' rows); up to 9 seen with a slow consumer, and 33 MiB mapped in all under
    # load (a bound of 32 MiB flaked). No exact bound: half the top, which a run that never
    # gives pages back exceeds by the epoch's end (kept, the control, maps all of it).
    assert 0 < peaks[False] <= 64 * 1024, peaks
    assert peaks[True] >= 128 * 1024, peaks


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_chunks_of_epochs_left_early_are_unmapped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leaving epochs after one batch (the run ends with chunks made ready and not done with):
    those chunks are given back when the run ends, so the mapped pages stay within the chunks in
    flight, and none is live once the layer is closed. 64 MiB a top in chunks of 2 MiB a top:
    kept live, the left chunks of six epochs had mapped 47 MiB of the top (found by review)."""
    path = _big(tmp_path / "big.h5", 2**23)
    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    readers: list[Any] = []
    init = mapped.MappedReader.__init__

    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        readers.append(self)

    monkeypatch.setattr(mapped.MappedReader, "__init__", recorded)
    before = await asnapshot()
    peak = 0
    with anyio.fail_after(60):
        async with _streamed(path, batch_size=2**12) as layer:
            for _ in range(6):
                async for b in layer:
                    np.testing.assert_array_equal(b["data"], b.indices * 10)
                    break
                # The run reads ahead while nobody takes batches (more chunks left): until it
                # has made 8 chunks ready (16 MiB of a top; left alone it fills its pipeline,
                # about 17), not for a fixed time, which a loaded machine may spend before the
                # first read.
                while max(mappings(path)) < 16 * 1024:
                    await anyio.sleep(0.01)
            async for i, b in _enumerate(layer):
                np.testing.assert_array_equal(b["data"], b.indices * 10)
                if i % 8 == 0:
                    peak = max(peak, max(mappings(path)))
    await aassert_released(before)
    # Every run gave its chunks back when it ended (exact, whatever the load: a left chunk kept
    # live stays in the count for the layer's life).
    (reader,) = readers
    assert not reader._live, reader._live
    # KiB of one top: the chunks in flight and the folios at their ends, not the top's 64 MiB.
    # How many are in flight depends on how far the pipeline runs ahead of its consumer, which
    # is the load: the most is a full pipeline (a consumer slower than the reader, as on a
    # loaded machine): 6 groups of 2**19 rows (the 4 cut and not yet taken, the 2 the consumer
    # may hold) span at most 13 chunks of 2**18, the reader's 4 ahead of the batcher, and the
    # 2 given back since the last read (dropped by the next): 19 chunks, 38 MiB, and up to a
    # 2 MiB folio beside a few of them. Seen: 16-21 MiB on a busy machine, 32-36 MiB filled with
    # an idle consumer (a bound of 32 MiB flaked under load). So the peak alone cannot tell the
    # left chunks from the load (each left run keeps about one chunk past those in flight): the
    # count above does, and the peak guards against mapping the whole top.
    assert 0 < peak <= 48 * 1024, peak
    assert mappings(path, collect=True) == []


async def _enumerate(it: Any) -> Any:
    i = 0
    async for x in it:
        yield i, x
        i += 1


# --- the documented hazard ----------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_chunk_made_ready_whose_order_was_cancelled_is_unmapped_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's rows are made ready and its serving order drawn at once. When the consumer
    leaves while the rows are ready and the order is still being drawn, the load is cancelled
    with no chunk to hand on: its rows must be given back all the same, or each epoch left
    that way keeps one chunk mapped for the layer's life."""
    import asynchdf5._plan as plan

    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    readers: list[Any] = []
    init, order = mapped.MappedReader.__init__, plan.ChunkPlan.order

    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        readers.append(self)

    def slow(self: Any) -> Any:
        if self.index >= 1:  # the chunks after the first: drawn long after they are ready
            time.sleep(0.2)
        return order(self)

    monkeypatch.setattr(mapped.MappedReader, "__init__", recorded)
    monkeypatch.setattr(plan.ChunkPlan, "order", slow)
    path = write_h5(tmp_path / "one.h5", 0, N)
    with anyio.fail_after(60):
        async with AsyncHDF5DataLayer(
            path, batch_size=64, chunk_size=1024, shuffle=True, seed=0, mmap=True
        ) as layer:
            for _ in range(4):
                async for _b in layer:
                    break  # while the next chunk's order is drawn
                await anyio.sleep(0.4)  # the left run's threads are done
            async for _b in layer:
                pass
            (reader,) = readers
            live = sum(b - a for a, b in reader._live)
    # The run going on holds a chunk or two (1,024 rows each); each epoch left the old way
    # kept one more.
    assert live <= 2 * 1024, reader._live


# Run in a child process: were the lease not to hold, a gather would meet a truncated page and
# the SIGBUS would end the child, not the test run. The whole data set one chunk, made ready; the
# consumer sleeps after its first batch, so the groups ahead are gathered and the gather thread
# waits: nothing looks at the lease but its own thread. Then the file is truncated, by this
# process or another; the child reports what the run did.
_TRUNCATED_WHILE_SERVED = """
import os, subprocess, sys, time
import numpy as np
from asynchdf5 import HDF5DataLayer, ReadError
path, how, mode = sys.argv[1], sys.argv[2], sys.argv[3]
mode = True if mode == "True" else mode
writer = os.open(path, os.O_WRONLY) if how == "writer open before" else None
if how == "not the owner":  # a user who does not own it
    import anyio._backends._asyncio  # imported now: that user may not read the interpreter's files
    os.setgid(54321)
    os.setuid(54321)
got, waited = [], None
try:
    with HDF5DataLayer(path, batch_size=64, shuffle=True, seed=0, mmap=mode) as layer:
        print("notes", layer.stats.read_notes, flush=True)
        for i, b in enumerate(layer):
            got.append(b)
            if i == 0:
                time.sleep(0.5)
                t0 = time.monotonic()
                if how == "another process":
                    code = f"import os; os.truncate({path!r}, 4096)"
                    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
                elif how in ("this process", "not the owner"):
                    os.truncate(path, 4096)
                elif how == "O_RDONLY | O_TRUNC":  # truncates without looking at leases
                    code = f"import os; os.close(os.open({path!r}, os.O_RDONLY | os.O_TRUNC))"
                    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
                else:
                    os.ftruncate(writer, 4096)
                waited = time.monotonic() - t0
except ReadError as exc:
    print("ReadError", exc, flush=True)
for b in got:  # every batch yielded: the rows of the file as it was
    assert (b["label"] == b.indices).all() and (b["data"][:, 0] == b.indices * 10).all()
print("batches", len(got), "waited", waited, flush=True)
"""


def _child(script: str, *args: object) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a child Python (a SIGBUS ends only it), under a deadline. Without
    faulthandler (which ``nox -s tests`` turns on): the signal that ends the child is the one
    the kernel sent, not one raised while faulthandler walks the other threads' frames."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _truncate_while_served(
    path: Path, how: str, mode: bool | str = "auto"
) -> subprocess.CompletedProcess[str]:
    return _child(_TRUNCATED_WHILE_SERVED, path, how, mode)


@pytest.mark.parametrize(
    ("how", "stored"),
    [("another process", None), ("this process", None), ("another process", 1024)],
)
def test_a_file_truncated_while_its_chunk_is_served_is_a_read_error_under_the_lease(
    tmp_path: Path, how: str, stored: int | None
) -> None:
    """The layer holds a read lease on the mapped file: the truncation waits until no gather is
    in flight and the lease is given back (a poll away, not the kernel's 45 s), and the run ends
    with a ReadError naming the file, after correct batches only. Without the lease (the code
    before it) this child died of SIGBUS. Stored contiguously, or in ``stored`` chunks of that
    many whole rows (mapped under the lease as well)."""
    path = tmp_path / "one.h5"
    if stored is None:
        write_h5(path, 0, 200_000)
    else:
        with h5py.File(path, "w") as f:
            for name, arr in rows(0, 200_000).items():
                f.create_dataset(name, data=arr, chunks=(stored, *arr.shape[1:]))
    proc = _truncate_while_served(path, how)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    out = proc.stdout
    assert "read lease held" in out, out  # mapped, and guarded
    # Named as the copying reader names a read (issue 30 item 10): the top(s) and the rows.
    assert re.search(
        rf"ReadError top '[^\n]*, (\d+ )?rows( in)? \d+:\d+: {path}: the file was truncated", out
    ), out
    batches, waited = out.rsplit("batches ", 1)[1].split()[::2]
    assert int(batches) >= 1
    assert 0 <= float(waited) < 20, out  # the lease was given back, not timed out by the kernel


def test_without_a_lease_a_truncated_file_ends_the_process(tmp_path: Path) -> None:
    """What the docs warn of where no lease can be taken (here: the file is open for writing
    when the layer opens it): the rows are mapped all the same, the notes say they are not
    guarded, and a truncation while a chunk is served is a SIGBUS that ends the process. (The
    copying reader raises a ReadError here: tests/test_faults.py.)"""
    path = write_h5(tmp_path / "one.h5", 0, 200_000)
    proc = _truncate_while_served(path, "writer open before", True)
    assert "not guarded by a lease: the file is open for writing" in proc.stdout, proc.stdout
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-2000:])


# --- "auto" maps none of the documented SIGBUS cases that a check at open can tell -----------


def test_auto_copies_a_file_open_for_writing_and_a_truncation_is_a_read_error(
    tmp_path: Path,
) -> None:
    """No lease (the file is open for writing when the layer opens it): under "auto" the file is
    copied, not mapped, so the truncation that kills a mapped run without a lease (the test
    above) is a ReadError."""
    path = write_h5(tmp_path / "one.h5", 0, 200_000)
    proc = _truncate_while_served(path, "writer open before")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "copied: no read lease: the file is open for writing" in proc.stdout, proc.stdout
    _copied_after_truncation(proc.stdout)


def _copied_after_truncation(out: str) -> None:
    """The copying reader's answer to the truncation: the rows it had read (the whole data set,
    one chunk, read when the epoch began), every one correct (the child checks them), or a
    ReadError naming the change."""
    whole = f"batches {200_000 // 64} " in out
    assert whole or "the file was truncated after the source was opened" in out, out


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to become another user"
)
def test_auto_copies_a_file_this_process_does_not_own(tmp_path: Path) -> None:
    """No lease (Linux grants one only to the file's owner): copied, and a truncation (by
    root, who may) is a ReadError, not a SIGBUS."""
    # In a folder the other user can reach (pytest's tmp_path is root's only).
    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-"))
    try:
        folder.chmod(0o755)
        path = write_h5(folder / "one.h5", 0, 200_000)
        path.chmod(0o666)  # the other user may read it, and truncate it
        proc = _truncate_while_served(path, "not the owner")
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "copied: no read lease: this process does not own the file" in proc.stdout, proc.stdout
    _copied_after_truncation(proc.stdout)


@pytest.mark.parametrize(
    ("magic", "words"),
    [
        (0x6969, "network file system nfs"),
        (0xFF534D42, "network file system cifs"),
        (0xFE534D42, "network file system smb2"),
        (0x65735546, "FUSE file system"),
        (0x01021997, "network file system 9p"),
        (0x00C36400, "network file system ceph"),
        (0x0BD00BD0, "network file system lustre"),
        (0x12345678, "file system 0x12345678 is not known to be local"),
        (None, "the file system could not be told (statfs)"),
    ],
)
def test_network_fuse_and_unknown_file_systems_are_not_local(magic: int | None, words: str) -> None:
    """A lease there is this machine's: writes from another machine would not wait for it. The
    reason ``mmap="auto"`` gives for copying, by the magic number statfs answers (the whole
    pipeline with one of them: the test below)."""
    assert choice.not_local(magic) == words
    for local in choice.LOCAL_FILE_SYSTEMS:
        assert choice.not_local(local) is None


async def test_auto_copies_a_file_on_a_network_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No such mount here: the file system's magic number is what statfs would answer for NFS.
    ``mmap=True`` maps it all the same (as it always did)."""
    magic, words = 0x6969, "network file system nfs"
    monkeypatch.setattr(choice, "file_system", lambda fd: magic)
    path = write_h5(tmp_path / "one.h5", 0, N)
    with anyio.fail_after(30):
        got, stats = await batches(path, epochs=1, shuffle=True, seed=0, chunk_size=1000)
        _, forced = await batches(path, epochs=1, chunk_size=1000, mmap=True)
    check_epoch(got[0], N, 64, 0)
    assert stats.read_paths == {"data": "pread", "label": "pread"}
    assert stats.read_notes["data"] == f"copied: {words}"
    assert forced.read_paths["data"] == "mmap"


def test_the_local_file_systems_are_told_by_statfs(tmp_path: Path) -> None:
    """The real answer for this machine's folders: tmp_path and /dev/shm (tmpfs) are local."""
    for folder in (tmp_path, Path("/dev/shm")):
        if not folder.is_dir():
            continue
        fd = os.open(folder, os.O_RDONLY)
        try:
            magic = choice.file_system(fd)
        finally:
            os.close(fd)
        if sys.platform.startswith("linux"):
            assert magic in choice.LOCAL_FILE_SYSTEMS, (folder, magic)


async def test_auto_maps_a_file_on_tmpfs(tmp_path: Path) -> None:
    """tmpfs: local, no disk to fail, leases granted: mapped."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = write_h5(shm / f"asynchdf5-test-{os.getpid()}-{id(tmp_path)}.h5", 0, N)
    try:
        with anyio.fail_after(30):
            got, stats = await batches(path, epochs=1, shuffle=True, seed=0, chunk_size=1000)
    finally:
        path.unlink()
    check_epoch(got[0], N, 64, 0)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}
    assert stats.read_notes["data"] == "mapped: local file system tmpfs, read lease held"


def test_what_no_check_can_exclude_o_rdonly_o_trunc_still_ends_a_mapped_run(
    tmp_path: Path,
) -> None:
    """The documented hole that "auto" cannot see at open: another process opens the file with
    ``O_RDONLY | O_TRUNC``, which Linux truncates without breaking the read lease, and the
    mapped run ends with SIGBUS (docs/choosing.md says so, and to set ``mmap=False``)."""
    path = write_h5(tmp_path / "one.h5", 0, 200_000)
    proc = _truncate_while_served(path, "O_RDONLY | O_TRUNC")
    assert "read lease held" in proc.stdout, proc.stdout  # mapped, and guarded
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-2000:])


_TRUNCATED_WHILE_GATHERING = """
import os, subprocess, sys, threading, time
from asynchdf5 import HDF5DataLayer, ReadError
path = sys.argv[1]
waited = []
def writer():
    time.sleep(0.3)
    t0 = time.monotonic()
    code = f"import os; os.truncate({path!r}, 4096)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
    waited.append(time.monotonic() - t0)
n = 0
try:
    with HDF5DataLayer(path, batch_size=256, shuffle=True, seed=0, mmap=True) as layer:
        print("notes", layer.stats.read_notes, flush=True)
        thread = threading.Thread(target=writer)
        thread.start()
        for _ in range(1000):
            for b in layer:
                assert (b["label"] == b.indices).all()
                assert (b["data"][:, 0] == b.indices * 1024).all()
                n += 1
except ReadError as exc:
    print("ReadError", exc, flush=True)
thread.join()
print("batches", n, "waited", waited[0], flush=True)
"""


@pytest.mark.parametrize("attempt", range(2))
def test_a_file_truncated_while_gathers_are_in_flight_waits_for_them(
    tmp_path: Path, attempt: int
) -> None:
    """The consumer takes batches as fast as they come (rows of 4 KiB: the gather threads are
    busy), and another process truncates the file: the lease is given back only once no gather
    is in flight, so none meets a truncated page (a child process: a SIGBUS ends only it). Found
    by review: the tests above truncate while the gather waits, which a lease given back under
    a gather in flight passed too."""
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(20_000 * 1024, dtype=np.float32).reshape(20_000, 1024)
        f["label"] = np.arange(20_000, dtype=np.int64)
    proc = _child(_TRUNCATED_WHILE_GATHERING, path)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "read lease held" in proc.stdout, proc.stdout
    # The next copy sees the lease broken before or after the writer has truncated the file:
    # the lease's words, or the file's change.
    assert re.search(rf"ReadError top '[^\n]*rows[^\n]*: {path}: ", proc.stdout), proc.stdout
    words = ("the file was truncated", "opened the file for writing or truncated it")
    assert any(w in proc.stdout for w in words), proc.stdout
    waited = float(proc.stdout.rsplit("waited ", 1)[1])
    assert waited < 20, proc.stdout  # given back after the gathers, not timed out (45 s)


_FORKED_WHILE_OPEN = """
import os, subprocess, sys, time
from asynchdf5 import HDF5DataLayer
path = sys.argv[1]
with HDF5DataLayer(path, batch_size=64, shuffle=True, seed=0, mmap=True) as layer:
    print("notes", layer.stats.read_notes, flush=True)
    pid = os.fork()
    if pid == 0:  # a forked worker that lives on and never touches the layer
        time.sleep(60)
        os._exit(0)
    for i, b in enumerate(layer):
        if i == 3:
            break
t0 = time.monotonic()
code = f"import os; os.close(os.open({path!r}, os.O_WRONLY))"
try:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=25)
    print("waited", time.monotonic() - t0, flush=True)
finally:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
"""


def test_a_child_forked_while_the_layer_is_open_does_not_keep_the_lease(tmp_path: Path) -> None:
    """A forked child shares the open file the lease is on: closing the layer gives the lease
    back explicitly, so a writer opens the file at once, not after the kernel's lease-break
    time (found by review: 45 s)."""
    path = write_h5(tmp_path / "one.h5", 0, N)
    proc = _child(_FORKED_WHILE_OPEN, path)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "read lease held" in proc.stdout, proc.stdout
    assert float(proc.stdout.split("waited ")[1]) < 20, proc.stdout


@pytest.mark.parametrize("mode", [True, "auto"])
async def test_a_lease_is_not_taken_with_a_short_lease_break_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bool | str
) -> None:
    """The kernel gives a lease up after the lease-break time: under a few seconds, a gather in
    flight could outlast it, so the file is mapped unguarded (``mmap=True``) or copied
    ("auto"), and the notes say why."""
    import asynchdf5._read._lease as lease

    fake = tmp_path / "lease-break-time"
    fake.write_text("1\n")
    monkeypatch.setattr(lease, "_BREAK_TIME", str(fake))
    path = write_h5(tmp_path / "one.h5", 0, N)
    with anyio.fail_after(30):
        got, stats = await batches(path, shuffle=True, seed=0, chunk_size=1000, mmap=mode)
    for epoch, epoch_batches in enumerate(got):
        check_epoch(epoch_batches, N, 64, epoch)
    if mode is True:
        assert stats.read_paths["data"] == "mmap"
        assert "not guarded by a lease: the lease-break time is 1 s" in stats.read_notes["data"]
    else:
        assert stats.read_paths["data"] == "pread"
        assert "copied: no read lease: the lease-break time is 1 s" in stats.read_notes["data"]


async def test_a_writer_that_changes_nothing_still_ends_the_mapped_run(tmp_path: Path) -> None:
    """Another program opens the file for writing and closes it: it waits for the layer to give
    the lease back, and the run ends with a ReadError saying so (the rows could have changed);
    after the layer closes, a writer opens the file at once."""
    path = write_h5(tmp_path / "one.h5", 0, N)
    before = await asnapshot()
    opener = [sys.executable, "-c", f"import os; os.close(os.open({str(path)!r}, os.O_WRONLY))"]
    got: list[Any] = []
    with anyio.fail_after(60), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=16, chunk_size=1000, shuffle=True, seed=0, mmap=True
        ) as layer:
            for _ in range(3):
                async for b in layer:
                    got.append(b)
                    if len(got) == 1:
                        await anyio.run_process(opener)
    await aassert_released(before)
    assert 1 <= len(got) < 3 * N // 16
    for b in got:
        np.testing.assert_array_equal(b["data"][:, 0], b.indices * 10)
    # The top and the rows too (issue 30 item 10), as the copying reader's errors name them.
    check_message(info.value, path, "opened the file for writing", "top '", "rows ")
    with anyio.fail_after(20):  # the lease went with the layer: no wait
        await anyio.run_process(opener)


# --- ragged and sparse tops -----------------------------------------------------------------------


def _ragged(path: Path, start: int = 0, n: int = N) -> Path:
    """``tok`` (a ragged group of rows 0..100 long, empty ones included: copied out of the
    mapped heap value by value and in blocks), ``X`` (a sparse matrix of as many values a row)
    beside ``label`` and ``len``, rows numbered from ``start``."""
    from .test_ragged import write_ragged

    write_ragged(path, start, n, longest=100)
    with h5py.File(path, "r+") as f:
        indptr = f["tok/indptr"][()]
        g = f.create_group("X")
        total = int(indptr[-1])
        g["data"] = np.arange(total, dtype=np.float32)
        g["indices"] = (np.arange(total) % 11).astype(np.int32)
        g["indptr"] = indptr
        g.attrs["shape"] = (n, 11)
        g.attrs["encoding-type"] = "csr_matrix"
    return path


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("kept", [True, False])
async def test_ragged_and_sparse_tops_are_mapped_and_give_the_copying_readers_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool, kept: bool
) -> None:
    """A ragged and a sparse top of one contiguous file: their heaps (values, column indices)
    mapped, their rows' spans from ``indptr``; the same batches as copied, every sample once an
    epoch; nothing mapped once closed."""
    if not kept:
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = _ragged(tmp_path / "r.h5")
    served, copied, stats = await _mapped_beside_copied(path, shuffle, "ragged-pread")
    with h5py.File(path) as f:  # the bytes mapped: the heaps' and the fixed tops'
        size = sum(f[k].nbytes for k in ("tok/data", "X/data", "X/indices", "label", "len"))
    if kept:  # every row mapped (read) once, never again
        assert stats.bytes_read == size
    else:  # read again every epoch
        assert stats.bytes_read >= 2 * size
    for epoch, (mine, theirs) in enumerate(zip(served, copied, strict=True)):
        seen = []
        for a, b in zip(mine, theirs, strict=True):
            assert a.epoch == epoch
            seen += a.indices.tolist()
            _alike(a, b)
            for i, g in enumerate(a.indices.tolist()):
                assert (a["tok"][i] == g).all()
        assert sorted(seen) == list(range(N))
    assert mappings(path, collect=True) == []


def test_a_mapped_ragged_tops_spans_are_indptr_seen_two_entries_a_row() -> None:
    """The mapped reader's spans of a ragged top (start, stop of each row in its heap) are a
    read-only view of ``indptr``, not a copy of 16 bytes a row; its rows are those a stacked
    copy had, taken by fancy index as the gather takes them."""
    ip = np.array([0, 3, 3, 7, 12], np.int64)
    spans = mapped._spans_of(ip)
    assert np.shares_memory(spans, ip) and not spans.flags.writeable
    assert np.array_equal(spans, np.stack([ip[:-1], ip[1:]], axis=1))
    assert spans[np.array([3, 0, 1])].tolist() == [[7, 12], [0, 3], [3, 3]]
    assert spans[1:3].tolist() == [[3, 3], [3, 7]]
    assert mapped._spans_of(np.zeros(1, np.int64)).shape == (0, 2)


async def test_a_ragged_top_in_several_files_is_copied_and_says_why(tmp_path: Path) -> None:
    for i, (start, n) in enumerate([(0, 3000), (3000, N - 3000)]):
        _ragged(tmp_path / f"part{i}.h5", start, n)
    (tmp_path / "list.txt").write_text("part0.h5\npart1.h5\n")
    with anyio.fail_after(30):
        got, stats = await batches(tmp_path / "list.txt", epochs=1, tops=("tok", "label"))
    assert sorted(i for b in got[0] for i in b.indices.tolist()) == list(range(N))
    assert stats.read_paths["tok"] == "ragged-pread"
    assert stats.read_notes["tok"] == (
        "copied: top 'tok' has rows of varying length in 2 files: mapped from one file only"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mmap", ["auto", False])
def test_the_sources_verdict_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mmap: Literal["auto", False]
) -> None:
    """Whether the source is mapped, and why, is one line of the log at open, not repeated in
    each top's line."""
    write_h5(tmp_path / "a.h5", 0, 50)
    with caplog.at_level(logging.INFO, "asynchdf5"):
        with HDF5DataLayer(tmp_path / "a.h5", batch_size=16, mmap=mmap) as layer:
            for _ in layer:
                pass
            verdict = layer.stats.read_notes.get("data", "copied: mmap=False")
    assert verdict.startswith("mapped: " if mmap else "copied: "), verdict
    lines = [r.getMessage() for r in caplog.records]
    assert sum(verdict in line for line in lines) == 1, lines
    assert sum(line.startswith("top ") for line in lines) == 2, lines  # data's and label's


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mmap", ["auto", False])
def test_rows_of_no_bytes_are_read_as_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mmap: Literal["auto", False]
) -> None:
    """A top of shape (n, 0) (HDF5 never allocates its storage) has nothing to read: served
    beside the others, mapped or copied, without h5py and without keeping the source from
    being mapped (before: read through h5py as "not allocated", with a warning, and the whole
    source copied)."""
    paths = []
    for k, (start, n) in enumerate([(0, 70), (70, 45)]):
        paths.append(tmp_path / f"z{k}.h5")
        with h5py.File(paths[-1], "w") as f:
            f["label"] = np.arange(start, start + n)
            f["none"] = np.zeros((n, 0), np.float32)
    with caplog.at_level(logging.INFO, "asynchdf5"):
        with HDF5DataLayer(
            paths, tops=("none", "label"), batch_size=16, shuffle=True, mmap=mmap
        ) as layer:
            seen = []
            for b in layer:
                assert b["none"].shape == (len(b.indices), 0) and b["none"].dtype == np.float32
                np.testing.assert_array_equal(b["label"], b.indices)
                seen.append(b.indices)
            paths_ = layer.stats.read_paths
    check_exactly_once(seen, 115)
    assert paths_ == dict.fromkeys(("none", "label"), "mmap" if mmap else "pread"), paths_
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _once(epoch_batches: list[Any], n: int, epoch: int) -> None:
    """Batches of epoch ``epoch``, every sample of ``n`` in them exactly once."""
    assert {b.epoch for b in epoch_batches} == {epoch}
    check_exactly_once([b.indices for b in epoch_batches], n)


async def _mapped_beside_copied(
    path: Path, shuffle: bool, copied_path: str
) -> tuple[list[list[Any]], list[list[Any]], Any]:
    """Two epochs of ``_ragged``'s tops mapped and copied (read path ``copied_path`` for
    ``tok``), each under a deadline, nothing left open: the mapped batches, the copied ones and
    the mapped layer's stats."""
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=4, chunk_size=1000, epochs=2)
    kw["tops"] = ("tok", "X", "label", "len")
    before = await asnapshot()
    with anyio.fail_after(60):
        copied, copied_stats = await batches(path, mmap=False, **kw)
        served, stats = await batches(path, **kw)
    await aassert_released(before)
    assert copied_stats.read_paths["tok"] == copied_path
    assert stats.read_paths == {"tok": "ragged-mmap", "X": "sparse-mmap", "label": "mmap"} | {
        "len": "mmap"
    }
    return served, copied, stats


def _alike(a: Any, b: Any) -> None:
    """Batch ``a`` of ``_ragged``'s tops (mapped) is batch ``b`` (copied), its rows aligned:
    ``label`` is the sample's index, ``len`` its ``tok`` row's length."""
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a["label"], a.indices)
    np.testing.assert_array_equal(a["tok"].offsets, b["tok"].offsets)
    np.testing.assert_array_equal(a["tok"].values, b["tok"].values)
    np.testing.assert_array_equal(a["tok"].lengths, a["len"])
    for part in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(a["X"], part), getattr(b["X"], part))


HEAPS = ("tok/data", "X/data", "X/indices")
#: Values a stored chunk of a heap holds: fewer than most rows (0..100 values), so rows cross
#: one chunk end or several.
HEAP_CHUNK = 37


def _chunk_heaps(path: Path, case: str) -> dict[str, np.ndarray]:
    """``_ragged``'s heaps (``tok/data``, ``X/data``, ``X/indices``) stored again in chunks of
    :data:`HEAP_CHUNK` values, unfiltered: written at once (``"chunks"``), chunk by chunk last to
    first (``"reverse"``: no chunk follows the one before it in the file), in parts with a 3-byte
    dataset written between them (``"pad"``: chunks at offsets not aligned for their values),
    all in one chunk (``"single chunk"``), ``tok``'s values of shape (3,) in chunks of whole
    values (``"trailing"``), or ``X``'s values as float64 and its column indices in chunks of
    another size, written last to first (``"mixed"``: the two heaps cut apart), or in groups of
    six chunks written in the order 0, 5, 2, 1, 3, 4 (``"interleaved"``: chunks 0 and 2 of a
    group at the same ``delta`` with chunk 5 between them in the file, chunk 1 elsewhere).
    Returns the heaps as h5py reads them."""
    with h5py.File(path, "r") as f:  # written anew: no free space of the old heaps reused
        old = {k: f[k][()] for k in ("label", "len", "tok/indptr", "X/indptr", *HEAPS)}
        attrs = dict(f["X"].attrs)
    libver = "earliest" if case == "reverse" else "latest"
    with h5py.File(path, "w", libver=libver) as f:
        for name in ("label", "len", "tok/indptr", "X/indptr"):
            f[name] = old[name]
        f["X"].attrs.update(attrs)
        for name in HEAPS:
            values = old[name]
            if case == "trailing" and name == "tok/data":
                values = np.repeat(values[:, None], 3, axis=1)
            if case == "mixed" and name == "X/data":
                values = values.astype(np.float64)
            size = 50 if case == "mixed" and name == "X/indices" else HEAP_CHUNK
            group, leaf = name.split("/")
            chunks = (len(values) if case == "single chunk" else size, *values.shape[1:])
            d = f[group].create_dataset(leaf, values.shape, values.dtype, chunks=chunks)
            starts = list(range(0, len(values), size))
            if case == "reverse" or (case == "mixed" and name == "X/indices"):
                starts.reverse()
            elif case == "interleaved":
                groups = [starts[g : g + 6] for g in range(0, len(starts), 6)]
                starts = [g[i] for g in groups for i in (0, 5, 2, 1, 3, 4) if i < len(g)]
                for a in starts:  # each chunk allocated as written (no chunk cache)
                    part = np.zeros((size, *values.shape[1:]), values.dtype)
                    part[: len(values) - a] = values[a : a + size]
                    d.id.write_direct_chunk((a, *[0] * (values.ndim - 1)), part.tobytes())
                continue
            elif case != "pad":
                d[...] = values
                continue
            for i, a in enumerate(starts):
                if case == "pad" and i % 50 == 1:
                    f.create_dataset(f"pad/{name}/{i}", data=np.zeros(3, np.uint8))
                d[a : a + size] = values[a : a + size]
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in HEAPS}


def _heap_offsets(path: Path, name: str) -> np.ndarray:
    """The file offsets of heap ``name``'s stored chunks, in value order."""
    infos: list[Any] = []
    with h5py.File(path, "r") as f:
        f[name].id.chunk_iter(infos.append)
    infos.sort(key=lambda i: i.chunk_offset)
    return np.array([i.byte_offset for i in infos], np.int64)


@pytest.mark.parametrize(
    ("case", "kept", "shuffle"),
    [
        ("chunks", True, False),
        ("chunks", True, True),
        ("chunks", False, True),  # each chunk unmapped after use
        ("reverse", True, False),
        ("reverse", True, True),
        ("pad", True, True),
        ("single chunk", True, True),
        ("trailing", False, True),
        ("mixed", True, True),
        ("interleaved", True, True),
    ],
)
async def test_ragged_and_sparse_heaps_in_chunks_are_mapped_and_give_the_copying_readers_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool, case: str, kept: bool
) -> None:
    """A ragged and a sparse top whose heaps are stored in unfiltered chunks of whole values,
    every chunk written, smaller than most rows (rows crossing one or several chunk ends, empty
    rows among them): mapped, each row's values copied as byte spans cut where the chunks
    holding them are not back to back in the file; the same batches as copied, every sample
    once an epoch, unshuffled and shuffled; every heap byte mapped once when kept; nothing
    mapped once closed. (Copied before: a heap was mapped only from contiguous storage.)"""
    if not kept:
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = _ragged(tmp_path / "r.h5")
    heaps = _chunk_heaps(path, case)
    offsets = _heap_offsets(path, "tok/data")
    if case == "reverse":  # nearly every chunk before the one it follows in the rows
        assert (np.diff(offsets) < 0).mean() > 0.9
    if case == "pad":  # some chunks at offsets that are no whole values from the others
        assert len(np.unique(offsets % 8)) > 1
    if case == "single chunk":
        assert len(offsets) == 1
    if case == "interleaved":  # chunks 0 and 2 of a group back to back but for chunk 5
        delta = offsets - np.arange(len(offsets)) * HEAP_CHUNK * heaps["tok/data"].itemsize
        assert (delta[0:-5:6] == delta[2:-3:6]).all() and (delta[0:-5:6] != delta[1:-4:6]).all()
    served, copied, stats = await _mapped_beside_copied(path, shuffle, "ragged-chunks")
    # Each top's note: the source's verdict, and what is said of that top only.
    tail = "a row's values copied from the mapped chunks as one span within a run, cut where a "
    tail += "run ends"
    note, x = stats.read_notes["tok"], stats.read_notes["X"]
    assert note.startswith("mapped: ") and "top 'tok': data chunked (" in note, note
    assert "top 'X'" not in note and note.endswith(tail), note
    assert "top 'X': data chunked (" in x and " and indices chunked (" in x, x
    assert "top 'tok'" not in x and x.endswith(tail), x
    assert stats.read_notes["label"] == note.split("; ")[0]  # the verdict alone
    with h5py.File(path) as f:
        size = sum(f[k].nbytes for k in (*HEAPS, "label", "len"))
    if kept:
        assert stats.bytes_read == size
    else:
        assert stats.bytes_read >= 2 * size
    tok = heaps["tok/data"]
    with h5py.File(path) as f:
        indptr = f["tok/indptr"][()]
    for epoch, (mine, theirs) in enumerate(zip(served, copied, strict=True)):
        _once(mine, N, epoch)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            _alike(a, b)
            for i, g in enumerate(a.indices.tolist()):
                np.testing.assert_array_equal(a["tok"][i], tok[indptr[g] : indptr[g + 1]])
    assert mappings(path, collect=True) == []


async def test_a_chunked_heap_padded_as_gathered_gives_the_copying_readers_batches(
    tmp_path: Path,
) -> None:
    """``Pad`` at the head of a chunked, mapped heap's chain: its rows padded straight out of
    the mapped chunks (runs cut at chunk ends), the same arrays as copied."""
    from asynchdf5 import transforms as T

    path = _ragged(tmp_path / "r.h5")
    _chunk_heaps(path, "reverse")
    kw: dict[str, Any] = dict(shuffle=True, seed=2, chunk_size=1000, epochs=1, tops=("tok",))
    kw["transformers"] = [("tok", T.Pad(-1, length=60))]
    with anyio.fail_after(60):
        copied, _ = await batches(path, mmap=False, **kw)
        served, stats = await batches(path, **kw)
    assert stats.read_paths == {"tok": "ragged-mmap"}
    _once(served[0], N, 0)
    for a, b in zip(served[0], copied[0], strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a["tok"], b["tok"])


@pytest.mark.timeout(120)
def test_an_anndata_sparse_h5ad_is_mapped_and_gives_the_copying_readers_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sparse ``.h5ad`` as the ``anndata`` package writes it (``X/data`` and ``X/indices``
    chunked, unfiltered): served mapped by default (it was copied), ``inspect`` and the read
    note say how its heaps are read, and every batch, shuffled and not, is the copying
    reader's, every cell once an epoch."""
    anndata = pytest.importorskip("anndata")
    import pandas as pd
    import scipy.sparse

    from asynchdf5._cli import main

    n = 3000
    m = scipy.sparse.random(n, 400, density=0.08, format="csr", random_state=3, dtype=np.float32)
    keep = np.ones(n, np.float32)
    keep[::97] = 0  # some cells without a count
    m = scipy.sparse.csr_matrix(scipy.sparse.diags(keep) @ m)
    m.eliminate_zeros()
    assert (np.diff(m.indptr)[::97] == 0).all()
    obs = pd.DataFrame({"nnz": np.diff(m.indptr)}, index=[f"c{i}" for i in range(n)])
    path = tmp_path / "cells.h5ad"
    anndata.AnnData(X=m, obs=obs).write_h5ad(path)
    with h5py.File(path) as f:
        chunks = f["X/data"].chunks
        assert chunks is not None and f["X/data"].compression is None, chunks
        assert chunks[0] < m.nnz and f["X/indices"].chunks is not None
    status = main(["inspect", str(path), "--tops", "X", "--json"])
    said = json.loads(capsys.readouterr().out)["mmap"]
    assert status == 0 and said.startswith("mapped: "), said
    assert "top 'X': data chunked (" in said and " and indices chunked (" in said, said
    dense = m.toarray()
    for shuffle in (False, True):
        got = {}
        for mode in (False, "auto"):
            out = []
            with HDF5DataLayer(
                path, tops=("X", "obs/nnz"), batch_size=100, shuffle=shuffle, seed=5, mmap=mode,
                chunk_size=700,
            ) as layer:  # fmt: skip
                for _ in range(2):
                    out.append(list(layer))
                paths, notes = layer.stats.read_paths, layer.stats.read_notes
            got[mode] = out
            if mode == "auto":
                assert paths == {"X": "sparse-mmap", "obs/nnz": "mmap"}, notes
                assert "top 'X': data chunked (" in notes["X"], notes
        for epoch, (mine, theirs) in enumerate(zip(got["auto"], got[False], strict=True)):
            _once(mine, n, epoch)
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(a.indices, b.indices)
                for part in ("data", "indices", "indptr"):
                    np.testing.assert_array_equal(getattr(a["X"], part), getattr(b["X"], part))
                np.testing.assert_array_equal(a["X"].toarray(), dense[a.indices])
                np.testing.assert_array_equal(np.diff(a["X"].indptr), a["obs/nnz"])


def _no_values(path: Path, storage: str, n: int = 300, start: int = 0) -> Path:
    """``tok`` (ragged) and ``X`` (sparse, 11 columns) whose heaps hold no values (shape
    ``(0,)``, ``indptr`` all zeros), beside ``label`` and ``len`` (zeros), rows numbered from
    ``start``: the heaps ``chunked`` (``maxshape=(None,)``, as h5py and anndata make them), or
    ``contiguous`` (never allocated); ``anndata``: ``X`` written by the ``anndata`` package."""
    from .test_ragged import write_ragged

    write_ragged(path, start, n, lengths=np.zeros(n, np.int64))
    kw: dict[str, Any] = {} if storage == "contiguous" else dict(chunks=True, maxshape=(None,))
    with h5py.File(path, "r+") as f:
        if storage != "contiguous":
            del f["tok/data"]
            f["tok"].create_dataset("data", (0,), np.int64, **kw)
        if storage != "anndata":
            g = f.create_group("X")
            g.create_dataset("data", (0,), np.float32, **kw)
            g.create_dataset("indices", (0,), np.int32, **kw)
            g["indptr"] = np.zeros(n + 1, np.int64)
            g.attrs["shape"] = (n, 11)
            g.attrs["encoding-type"] = "csr_matrix"
    if storage == "anndata":
        anndata = pytest.importorskip("anndata")
        import scipy.sparse

        x = anndata.AnnData(X=scipy.sparse.csr_matrix((n, 11), dtype=np.float32))
        x.write_h5ad(path.with_suffix(".h5ad"))
        with h5py.File(path.with_suffix(".h5ad")) as src, h5py.File(path, "r+") as f:
            assert src["X/data"].shape == (0,) and src["X/data"].chunks is not None
            src.copy(src["X"], f, "X")
    with h5py.File(path) as f:
        for key in ("tok/data", "X/data", "X/indices"):
            assert f[key].shape == (0,) and (f[key].chunks is None) == (storage == "contiguous")
    return path


def _no_values_epochs(
    paths: list[Path], n: int, caplog: pytest.LogCaptureFixture, **kw: Any
) -> tuple[dict[str, str], dict[str, str]]:
    """Two epochs of ``_no_values``' tops (and ``_ragged``'s, where a file has values), each
    sample once an epoch with its own rows, and no warning: the read paths and notes."""
    caplog.clear()
    with caplog.at_level(logging.INFO, "asynchdf5"):
        with HDF5DataLayer(
            paths, tops=("tok", "X", "label", "len"), batch_size=64, seed=5, chunk_size=100, **kw
        ) as layer:
            for epoch in range(2):
                got = list(layer)
                _once(got, n, epoch)
                for b in got:
                    np.testing.assert_array_equal(b["label"], b.indices)
                    np.testing.assert_array_equal(b["tok"].lengths, b["len"])
                    np.testing.assert_array_equal(np.diff(b["X"].indptr), b["len"])
                    assert b["X"].shape == (len(b.indices), 11)
                    for i, g in enumerate(b.indices.tolist()):
                        assert (b["tok"][i] == g).all()
            paths_, notes = dict(layer.stats.read_paths), dict(layer.stats.read_notes)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [], warned
    return paths_, notes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["chunked", "contiguous", "anndata"])
def test_heaps_of_no_values_are_mapped_with_no_read_and_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
    storage: str,
) -> None:  # fmt: skip
    """A ragged and a sparse top whose heaps hold no values (a shard of an ``.h5ad`` with no
    non-zero counts): nothing of them is read, so no h5py path, no warning and no fill-value
    note; mapped by default as a heap of values is (kept between epochs or not), and every
    sample once an epoch with its empty rows, mapped or copied, shuffled or not (they were read
    through h5py and copied)."""
    from asynchdf5._cli import main

    path = _no_values(tmp_path / "z.h5", storage)
    fast = "chunks" if storage != "contiguous" else "pread"
    for shuffle in (False, True):
        paths, notes = _no_values_epochs([path], 300, caplog, shuffle=shuffle, mmap=False)
        assert paths == {"tok": f"ragged-{fast}", "X": f"sparse-{fast}", "label": "pread",
                         "len": "pread"}, notes  # fmt: skip
        assert notes == {}, notes  # no fill value, no h5py read
        with pytest.MonkeyPatch.context() as mp:
            if shuffle:  # mapped pages dropped after each chunk, as a data set not kept
                mp.setattr(mapped, "default_keep_bytes", lambda: 0)
            paths, notes = _no_values_epochs([path], 300, caplog, shuffle=shuffle)
        assert paths == {"tok": "ragged-mmap", "X": "sparse-mmap", "label": "mmap",
                         "len": "mmap"}, notes  # fmt: skip
        assert all(note.startswith("mapped: ") for note in notes.values()), notes
    status = main(["inspect", str(path), "--tops", "X", "tok", "--json"])
    said = json.loads(capsys.readouterr().out)["mmap"]
    assert status == 0 and said.startswith("mapped: "), said
    assert mappings(path, collect=True) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", ["chunked", "contiguous"])
def test_a_heap_of_no_values_beside_a_file_with_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, storage: str
) -> None:
    """Two files, one whose heaps hold no values and one whose heaps hold some: copied (a
    ragged top in several files), every sample once an epoch with its own rows, and the empty
    heaps read through no h5py path, with no warning (they were)."""
    empty = _no_values(tmp_path / "a.h5", storage, n=200)
    full = _ragged(tmp_path / "b.h5", start=200, n=400)
    for shuffle in (False, True):
        for mmap in (False, "auto"):
            paths, notes = _no_values_epochs([empty, full], 600, caplog, shuffle=shuffle, mmap=mmap)
            assert not any("h5py" in p for p in paths.values()), paths
            assert not any("fill values" in note for note in notes.values()), notes
            if mmap == "auto":
                assert notes["tok"].startswith("copied: ") and "in 2 files" in notes["tok"]


@pytest.mark.parametrize("case", ["gzip", "unwritten"])
async def test_a_heap_in_chunks_it_cannot_map_is_copied_and_says_what_it_needs(
    tmp_path: Path, case: str
) -> None:
    """A heap in filtered chunks, or with a chunk never written (h5py reads its fill value):
    copied, every row as h5py reads it, and the note says what mapping needs (heaps are now
    mapped from unfiltered chunks, every one written)."""
    path = _ragged(tmp_path / "r.h5")
    with h5py.File(path, "r+") as f:
        values = f["tok/data"][()]
        del f["tok/data"]
        if case == "gzip":
            f["tok"].create_dataset("data", data=values, chunks=(64,), compression="gzip")
        else:  # the chunk holding values 64:128 never written (no row of the file is there)
            d = f["tok"].create_dataset("data", values.shape, values.dtype, chunks=(64,))
            d[:64], d[128:] = values[:64], values[128:]
            values[64:128] = 0
    with h5py.File(path) as f:
        indptr = f["tok/indptr"][()]
    with anyio.fail_after(30):
        got, stats = await batches(path, epochs=1, tops=("tok", "label"), mmap=True)
    _once(got[0], N, 0)
    for b in got[0]:
        for i, g in enumerate(b.indices.tolist()):
            np.testing.assert_array_equal(b["tok"][i], values[indptr[g] : indptr[g + 1]])
    needs = (
        "mapping needs contiguous storage or unfiltered chunks of whole values, every chunk "
        "written (the heap of a ragged or sparse top)"
    )
    if case == "gzip":
        assert stats.read_paths["tok"] == "ragged-chunks"
        assert stats.read_notes["tok"] == (
            f"copied: top 'tok' (its data) is stored chunked (64,), filtered: {needs}"
        )
    else:
        assert stats.read_paths["tok"] == "ragged-h5py"
        assert stats.read_notes["tok"].endswith(
            f"copied: top 'tok' (its data) is read through h5py (chunks not all written (fill "
            f"values)): {needs}"
        ), stats.read_notes["tok"]


async def test_a_lease_broken_before_a_ragged_gather_is_a_read_error_naming_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease's check runs right before each copy out of a mapped heap, as before a fixed
    top's: a broken lease ends the run with a ReadError naming the top and the rows, not a
    batch read from pages that may be gone."""
    path = _ragged(tmp_path / "r.h5")

    def broken(self: Lease) -> None:
        raise ReadError(f"{path}: the lease was broken (a stand-in)")

    monkeypatch.setattr(Lease, "__enter__", broken)
    before = await asnapshot()
    got = []
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(path, tops=("tok",), batch_size=64, seed=0) as layer:
            assert layer.stats.read_paths == {"tok": "ragged-mmap"}
            async for b in layer:
                got.append(b)
    await aassert_released(before)
    assert got == []
    check_message(info.value, "top 'tok', ", "rows ", "the lease was broken")


# --- tops stored in chunks of whole samples ----------------------------------------------------

CHUNK = 64  # rows a stored chunk: N is not a multiple, so the last chunk is partial


def _chunked(
    path: Path,
    how: str,
    *,
    unwritten: int | None = None,
    parts: tuple[int, ...] = (1500, 3333),
    pad: bool = False,
) -> dict[str, np.ndarray]:
    """``write_h5``'s rows in stored chunks of :data:`CHUNK` whole rows, written at once
    (``chunks=``) or appended in parts (split at ``parts``), each dataset resized first
    (``maxshape=(None, ...)``, as an appending writer does: the two tops' chunks interleave in
    the file). Stored chunk ``unwritten`` of ``data`` is never written (HDF5 reads its fill
    value). ``pad``: a dataset of 3 bytes written after each part, so that the chunks after it
    lie at offsets 3 bytes off whole rows from those before. Returns what h5py reads."""
    want = {k: v for k, v in rows(0, N).items()}
    with h5py.File(path, "w") as f:
        for name, arr in want.items():
            chunks = (CHUNK, *arr.shape[1:])
            if how == "chunks":
                f.create_dataset(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks)
            else:
                f.create_dataset(
                    name, shape=(0, *arr.shape[1:]), dtype=arr.dtype, chunks=chunks,
                    maxshape=(None, *arr.shape[1:]),
                )  # fmt: skip
        cuts = (0, *parts, N)
        for a, b in itertools.pairwise(cuts):
            if pad and a:
                f.create_dataset(f"pad{a}", data=np.zeros(3, np.uint8))
            for name, arr in want.items():
                d = f[name]
                if how != "chunks":
                    d.resize(b, axis=0)
                if name == "data" and unwritten is not None:
                    hole = range(unwritten * CHUNK, (unwritten + 1) * CHUNK)
                    for lo, hi in ((a, min(b, hole.start)), (max(a, hole.stop), b)):
                        if lo < hi:
                            d[lo:hi] = arr[lo:hi]
                    continue
                d[a:b] = arr[a:b]
    with h5py.File(path, "r") as f:
        assert f["data"].chunks == (CHUNK, 2) and N % CHUNK
        return {name: f[name][:] for name in want}


@pytest.mark.parametrize("how", ["chunks", "maxshape"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    ("chunk_size", "kept"),
    [(1000, True), (1000, False), (2**20, True)],  # streaming, unmapped after use; resident
)
async def test_chunked_tops_of_whole_samples_are_mapped_and_give_h5pys_rows(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    shuffle: bool,
    chunk_size: int,
    kept: bool,
) -> None:
    """Unfiltered chunks of whole rows, written with ``chunks=`` or appended to a
    ``maxshape=`` dataset, the last chunk partial: served mapped by default, every batch the rows
    h5py reads at its indices, every sample exactly once an epoch; every byte mapped once when
    kept, again each epoch when not; nothing mapped once closed."""
    if not kept:
        monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = tmp_path / "c.h5"
    want = _chunked(path, how)
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=3, chunk_size=chunk_size, epochs=3)
    if chunk_size < N:
        kw["cache_bytes"] = 2 * chunk_size * ROW_BYTES
    before = await asnapshot()
    with anyio.fail_after(60):
        served, stats = await batches(path, **kw)
    await aassert_released(before)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}
    for note in stats.read_notes.values():
        assert note.startswith("mapped: ") and note.endswith(", read lease held"), note
    if kept:
        assert stats.bytes_read == N * ROW_BYTES
    else:
        assert stats.bytes_read >= 2 * N * ROW_BYTES
    check_rows(served, want)
    assert mappings(path, collect=True) == []


def _phases(path: Path) -> np.ndarray:
    """How many of ``data``'s stored chunks lie at each offset modulo its row's bytes."""
    offsets: list[int] = []
    with h5py.File(path, "r") as f:
        f["data"].id.chunk_iter(lambda info: offsets.append(info.byte_offset))
    _, counts = np.unique(np.asarray(offsets) % 8, return_counts=True)
    return np.sort(counts)[::-1]


@pytest.mark.parametrize("shuffle", [False, True])
async def test_chunks_of_a_few_at_another_phase_are_mapped_and_those_rows_fetched_again(
    tmp_path: Path, shuffle: bool
) -> None:
    """Appended with 3 bytes written between the parts: a few of ``data``'s chunks lie at
    offsets that differ from the others' by no whole row. Mapped all the same (most rows are
    one array of the mapping), each batch the rows h5py reads, the few taken from their own
    phase's array."""
    path = tmp_path / "c.h5"
    want = _chunked(path, "maxshape", parts=(4800,), pad=True)
    counts = _phases(path)
    assert len(counts) > 1 and counts[0] >= choice.MAIN_PHASE * counts.sum(), counts
    with anyio.fail_after(60):
        served, stats = await batches(path, shuffle=shuffle, seed=2, chunk_size=1000)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}
    check_rows(served, want)


async def test_chunks_at_many_phases_held_resident_are_copied_and_say_why(tmp_path: Path) -> None:
    """Chunks split between offsets of several phases, none holding 7/8 of them (as the v1
    B-tree nodes of an h5py file of wide rows leave them), the data set held resident: mapped,
    its rows would take two copies each epoch where the resident copy takes one, so the source
    is copied, and the notes say why."""
    path = tmp_path / "c.h5"
    want = _chunked(path, "maxshape", pad=True)
    counts = _phases(path)
    assert counts[0] < choice.MAIN_PHASE * counts.sum(), counts
    with anyio.fail_after(60):
        got, stats = await batches(path, epochs=1, shuffle=True, seed=0, chunk_size=2**20)
    assert stats.read_paths == {"data": "chunks", "label": "chunks"}
    assert (
        f"copied: top 'data' is stored chunked ({CHUNK}, 2), its chunks at {len(counts)} "
        "different offsets modulo its row's 8 bytes"
    ) in stats.read_notes["data"]
    assert (
        "held resident, a row is one copy from memory; mapped, its rows would be gathered phase "
        "by phase, two copies a row"
    ) in stats.read_notes["data"]
    check_epoch(got[0], N, 64, 0)
    for b in got[0]:
        np.testing.assert_array_equal(b["data"], want["data"][b.indices])


def check_rows(served: list[list[Any]], want: dict[str, np.ndarray]) -> None:
    """Every epoch of ``served`` whole (each of the :data:`N` samples once, batches of 64), and
    each batch's rows of every top in ``want`` (what h5py reads) those at its indices."""
    for epoch, got in enumerate(served):
        check_epoch(got, N, 64, epoch)
        for b in got:
            for top, stored in want.items():
                np.testing.assert_array_equal(b[top], stored[b.indices])


WIDE = 50  # floats a row of the default-libver file: rows of 200 bytes
WIDE_CHUNK = 8  # rows a stored chunk: 626 chunks, the last partial


def _default_libver(path: Path, start: int = 0, stop: int = N) -> dict[str, np.ndarray]:
    """Rows ``start:stop`` of :data:`WIDE` float32 (row ``r``: ``10 * r + i``, exact, as
    ``write_h5``'s rows start) and int64 labels (``r``), written as a user appends them with
    h5py's default libver: chunks of :data:`WIDE_CHUNK` rows (labels: 64), ``maxshape=(None,
    ...)``, 1,000 rows a write. The v1 B-tree's nodes lie between runs of chunks, leaving
    ``data``'s chunks at many phases.
    Returns what h5py reads."""
    with h5py.File(path, "w") as f:
        d = f.create_dataset(
            "data", (0, WIDE), np.float32, chunks=(WIDE_CHUNK, WIDE), maxshape=(None, WIDE)
        )
        lab = f.create_dataset("label", (0,), np.int64, chunks=(64,), maxshape=(None,))
        for a in range(start, stop, 1000):
            b = min(stop, a + 1000)
            d.resize(b - start, axis=0)
            lab.resize(b - start, axis=0)
            d[a - start : b - start] = np.arange(a, b)[:, None] * 10 + np.arange(WIDE)
            lab[a - start : b - start] = np.arange(a, b)
    with h5py.File(path, "r") as f:
        return {"data": f["data"][:], "label": f["label"][:]}


def _chunk_phases(path: Path, row_bytes: int) -> np.ndarray:
    """Each stored chunk's phase (offset modulo ``row_bytes``), in row order."""
    found: list[tuple[int, int]] = []
    with h5py.File(path, "r") as f:
        f["data"].id.chunk_iter(lambda i: found.append((i.chunk_offset[0], i.byte_offset)))
    return np.asarray([o for _, o in sorted(found)], np.int64) % row_bytes


class _Spy:
    """What :meth:`ChunkRows.take` was asked, on ``data`` (rows of :data:`WIDE` floats): the
    takes spread over many phases, and the most phases one take's rows were at."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_phase, self.most = 0, 0
        self.arrays: list[Any] = []
        take, by_phase = ChunkRows.take, ChunkRows._by_phase

        def spy_take(rows: Any, indices: np.ndarray, *args: Any, **kw: Any) -> np.ndarray:
            if rows.shape[1:] == (WIDE,):
                k = np.asarray(indices, np.int64) // rows.chunk_rows
                self.most = max(self.most, len(np.unique(rows.phase[k])))
                self.arrays.append(rows)
            return take(rows, indices, *args, **kw)

        def spy_by_phase(rows: Any, *args: Any) -> None:
            self.by_phase += 1
            by_phase(rows, *args)

        monkeypatch.setattr(ChunkRows, "take", spy_take)
        monkeypatch.setattr(ChunkRows, "_by_phase", spy_by_phase)


@pytest.mark.parametrize("shuffle", [False, True])
async def test_chunks_of_h5pys_default_libver_streamed_are_mapped_and_give_h5pys_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """An appendable dataset of wide rows written with h5py's default libver, its chunks at
    many phases, the data set larger than the cache (streamed every epoch, where copying costs
    two copies a row too): mapped, the note says how its rows are gathered, and every batch is
    the rows h5py reads at its indices, of both tops, every sample once an epoch: batches over
    many phases (taken phase by phase, in pieces of the scratch), the first and last rows, the
    rows of chunks past the end of the main phase's array. Nothing left running, open or
    mapped once closed."""
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(maps, "SCRATCH_BYTES", 24 * WIDE * 4)  # pieces of 24 rows
    path = tmp_path / "wide.h5"
    want = _default_libver(path)
    phases = _chunk_phases(path, WIDE * 4)
    _, counts = np.unique(phases, return_counts=True)
    assert len(counts) >= 8 and counts.max() < choice.MAIN_PHASE * len(phases), counts
    row_bytes = WIDE * 4 + 8
    kw: dict[str, Any] = dict(shuffle=shuffle, seed=5, chunk_size=1000, epochs=2)
    kw["cache_bytes"] = 2 * 1000 * row_bytes  # two chunks of 1,000 rows: streamed
    kw["block_size"] = WIDE_CHUNK  # shuffled, a chunk's rows from runs of many phases
    before = await asnapshot()
    with anyio.fail_after(60):
        served, stats = await batches(path, **kw)
    await aassert_released(before)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}, stats.read_notes
    note = stats.read_notes["data"]
    assert note.startswith("mapped: local file system "), note
    spread = f"top 'data' is stored chunked ({WIDE_CHUNK}, {WIDE}), its chunks at {len(counts)} "
    assert f"read lease held; {spread}different offsets modulo its row's 200 bytes" in note, note
    assert note.endswith("its rows gathered phase by phase, two copies a row"), note
    check_rows(served, want)
    assert spy.by_phase > 0 and spy.most >= (8 if shuffle else 2), (spy.by_phase, spy.most)
    rows = spy.arrays[0]  # a chunk at another phase whose rows lie past the main array's end
    past = (rows.phase != 0) & (rows.first + WIDE_CHUNK > len(rows.phases[0]))
    assert past.any()
    del rows
    spy.arrays.clear()  # the spy's own references to the mapping
    assert mappings(path, collect=True) == []  # nothing mapped once closed (scratch included)


async def test_several_default_libver_files_streamed_are_mapped_and_give_the_copying_batches(
    tmp_path: Path,
) -> None:
    """Two such files (rows split at 2,200), streamed: mapped (a batch across both files taken
    from each file's phases), the same batches as copied, each the rows h5py reads."""
    want = [_default_libver(tmp_path / "a.h5", 0, 2200), _default_libver(tmp_path / "b.h5", 2200)]
    source = write_list(tmp_path, ["a.h5", "b.h5"])
    kw: dict[str, Any] = dict(shuffle=True, seed=6, chunk_size=1000, block_size=WIDE_CHUNK)
    kw["cache_bytes"] = 2 * 1000 * (WIDE * 4 + 8)
    with anyio.fail_after(60):
        copied, _ = await batches(source, mmap=False, **kw)
        served, stats = await batches(source, **kw)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}, stats.read_notes
    assert stats.read_notes["data"].endswith("its rows gathered phase by phase, two copies a row")
    data = np.concatenate([w["data"] for w in want])
    for epoch, (mine, theirs) in enumerate(zip(served, copied, strict=True)):
        check_epoch(mine, N, 64, epoch)
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a["data"], data[a.indices])
            np.testing.assert_array_equal(a["data"], b["data"])
            np.testing.assert_array_equal(a["label"], b["label"])


async def test_with_mmap_true_chunks_at_many_phases_held_resident_are_mapped(
    tmp_path: Path,
) -> None:
    """``mmap=True`` maps what the mapped reader can serve: chunks at many phases held
    resident too (slower epochs after the first than copying, as its note says), every batch
    the rows h5py reads."""
    path = tmp_path / "wide.h5"
    want = _default_libver(path)
    with anyio.fail_after(60):
        served, stats = await batches(path, shuffle=True, seed=1, mmap=True)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}, stats.read_notes
    assert stats.read_notes["data"].endswith("its rows gathered phase by phase, two copies a row")
    check_rows(served, want)


def test_inspect_says_chunks_at_many_phases_are_mapped_only_when_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asynchdf5 inspect`` on the default-libver file: copied where the default cache holds
    it resident, mapped where it would be streamed (a default cache smaller than the data set),
    each note saying why and how."""
    import asynchdf5._cli._inspect as inspect_module
    from asynchdf5._cli import main

    path = tmp_path / "wide.h5"
    _default_libver(path)
    assert main(["inspect", "--json", str(path)]) == 0
    note = json.loads(capsys.readouterr().out)["mmap"]
    assert note.startswith("copied: top 'data' is stored chunked (8, 50), its chunks at "), note
    assert note.endswith("mapped, its rows would be gathered phase by phase, two copies a row")
    monkeypatch.setattr(inspect_module, "default_cache_bytes", lambda: 2**16)
    assert main(["inspect", "--json", str(path)]) == 0
    note = json.loads(capsys.readouterr().out)["mmap"]
    assert note.startswith("mapped: local file system "), note
    assert note.endswith("its rows gathered phase by phase, two copies a row"), note


@pytest.mark.parametrize("mode", [True, "auto"])
async def test_a_chunk_never_written_is_copied_and_reads_the_fill_value(
    tmp_path: Path, mode: bool | str
) -> None:
    """Stored chunk 2 of ``data`` never written: HDF5 reads the fill value there, which no
    mapping holds, so the source is copied (h5py reads that top), the notes saying why; the
    batches are what h5py reads (zeros in those rows)."""
    path = tmp_path / "hole.h5"
    want = _chunked(path, "chunks", unwritten=2)
    assert not want["data"][2 * CHUNK : 3 * CHUNK].any()
    with anyio.fail_after(60):
        got, stats = await batches(path, epochs=1, shuffle=True, seed=0, mmap=mode)
    assert stats.read_paths["data"] == "h5py"
    note = stats.read_notes["data"]
    assert (
        "copied: top 'data' is read through h5py (chunks not all written (fill values)): " in note
    )
    assert "mapping needs contiguous storage or unfiltered chunks of whole samples" in note
    check_exactly_once([b.indices for b in got[0]], N)
    for b in got[0]:
        np.testing.assert_array_equal(b["data"], want["data"][b.indices])
        np.testing.assert_array_equal(b["label"], want["label"][b.indices])


async def test_a_mapped_chunked_run_resumes_exactly(tmp_path: Path) -> None:
    """Stopped after 20 batches of a shuffled epoch: a new layer given the state yields the
    rest as the first one did (the same indices and rows), mapped too, every sample of the
    epoch exactly once over both."""
    path = tmp_path / "c.h5"
    want = _chunked(path, "maxshape")
    kw: dict[str, Any] = dict(batch_size=64, shuffle=True, seed=4, chunk_size=1000)
    with anyio.fail_after(60):
        async with AsyncHDF5DataLayer(path, **kw) as layer:
            assert layer.stats.read_paths == {"data": "mmap", "label": "mmap"}
            it = aiter(layer)
            head = [await anext(it) for _ in range(20)]
            state = layer.state_dict()
            tail = [b async for b in it]
        async with AsyncHDF5DataLayer(path, **kw) as resumed:
            resumed.load_state_dict(state)
            assert resumed.stats.read_paths == {"data": "mmap", "label": "mmap"}
            rest = [b async for b in resumed]
    assert len(rest) == len(tail)
    for a, b in zip(rest, tail, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a["data"], want["data"][a.indices])
        np.testing.assert_array_equal(a["label"], want["label"][a.indices])
    check_exactly_once([b.indices for b in head + rest], N)


def _indexed(path: Path, case: str) -> dict[str, np.ndarray]:
    """``rows(0, N)`` in stored chunks of :data:`CHUNK` whole rows (or one larger chunk), the
    chunks written in another order or held by another kind of HDF5 chunk index (``libver=
    "latest"``: fixed array, extensible array, v2 B-tree, single chunk, implicit). Returns what
    h5py reads."""
    want = rows(0, N)
    libver = "earliest" if case in ("reverse", "one chunk") else "latest"
    with h5py.File(path, "w", libver=libver) as f:
        for name, arr in want.items():
            sample = arr.shape[1:]
            if case == "one chunk":  # partial: room for more rows than N
                f.create_dataset(name, data=arr, chunks=(2 * N, *sample), maxshape=(None, *sample))
                continue
            if case == "single chunk":  # the chunk is the whole fixed-size dataset
                f.create_dataset(name, data=arr, chunks=arr.shape)
                continue
            if case == "implicit":  # every chunk allocated when created: no index to look up
                plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                plist.set_chunk((CHUNK, *sample))
                plist.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                space = h5py.h5s.create_simple(arr.shape)
                h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(arr.dtype), space, plist)
                f[name][:] = arr
                continue
            maxshape = {"extensible array": (None, *sample), "v2 B-tree": (None,) * arr.ndim}
            d = f.create_dataset(
                name, shape=arr.shape, dtype=arr.dtype, chunks=(CHUNK, *sample),
                maxshape=maxshape.get(case),
            )  # fmt: skip
            starts = list(range(0, N, CHUNK))
            if case == "random":
                starts = np.random.default_rng(0).permutation(starts).tolist()
            else:
                starts.reverse()
            for a in starts:
                d[a : a + CHUNK] = arr[a : a + CHUNK]
    with h5py.File(path, "r") as f:
        return {name: f[name][:] for name in want}


@pytest.mark.parametrize(
    "case",
    [
        "reverse",
        "random",
        "extensible array",
        "v2 B-tree",
        "one chunk",
        "single chunk",
        "implicit",
    ],
)
async def test_chunks_written_out_of_order_or_held_by_any_chunk_index_are_mapped(
    tmp_path: Path, case: str
) -> None:
    """Chunks written last to first or at random, and the chunk indexes of both libvers: a
    row is at its own chunk's offset whatever the order of the chunks in the file, so each is
    mapped, every batch the rows h5py reads at its indices, every sample once an epoch."""
    path = tmp_path / "c.h5"
    want = _indexed(path, case)
    with anyio.fail_after(60):
        served, stats = await batches(path, shuffle=True, seed=1, chunk_size=1000)
    assert stats.read_paths == {"data": "mmap", "label": "mmap"}, stats.read_notes
    check_rows(served, want)


# --- asynchdf5 inspect ---------------------------------------------------------------------------


def test_inspect_says_whether_the_default_maps_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON's ``mmap`` and the text's last lines: what ``mmap="auto"`` does with the source
    now, as the layer would decide it (the lease taken and given back)."""
    from asynchdf5._cli import main

    plain = write_h5(tmp_path / "plain.h5", 0, N)
    gzip = write_h5(tmp_path / "z.h5", 0, N, layout="gzip")

    def inspect(*args: object) -> tuple[int, str]:
        status = main(["inspect", *map(str, args)])
        return status, capsys.readouterr().out

    status, out = inspect("--json", plain)
    assert status == 0 and json.loads(out)["mmap"].startswith("mapped: local file system ")
    status, out = inspect(plain)
    assert 'OK: the layer maps the file (mmap="auto", the default): mapped: local' in out, out
    with open(plain, "r+b"):  # open for writing: no lease
        status, out = inspect("--json", plain)
    assert json.loads(out)["mmap"] == "copied: no read lease: the file is open for writing"
    status, out = inspect(gzip)
    assert "OK: the layer reads data by chunks" in out, out
    assert "(mmap=\"auto\", the default: copied: top 'data' is stored chunked" in out, out
    t0 = time.monotonic()  # the lease was given back: a writer opens the file at once
    subprocess.run([sys.executable, "-c", f"open({str(plain)!r}, 'r+b')"], check=True, timeout=40)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the reader is the same on both
async def test_unmapping_spares_the_folios_of_the_chunks_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: a shuffled chunk of small blocks has pages in nearly every 2 MiB folio of the
    file, and the kernel maps a whole folio for any of its pages. Unmapping the rest of such a
    folio while a chunk in flight still has a page in it only made the next chunk map it again
    (thousands of ``MADV_DONTNEED`` and as many re-mappings an epoch): no page is unmapped in a
    2 MiB block of the file (aligned in the file) that a live chunk's rows lie in (that pages
    outside them still are: ``test_pages_of_chunks_done_with_are_unmapped_unless_kept``)."""
    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = _big(tmp_path / "big.h5", 2**21)  # 16 MiB a top: 8 blocks of 2 MiB
    fold = 2 * 2**20
    bad: list[tuple[str, int, int]] = []
    drop = mapped.MappedReader._drop_done

    def checked(self: mapped.MappedReader) -> None:
        live = list(self._live)
        calls: list[tuple[int, int]] = []
        madvise = self._libc.madvise

        def record(address: int, length: int, advice: int) -> int:
            if advice == mapped._DONTNEED:
                calls.append((address, length))
            return madvise(address, length, advice)

        self._libc.madvise = record  # type: ignore[method-assign]
        try:
            drop(self)
        finally:
            del self._libc.madvise
        for t in self._tops:
            base = t.offset - t.skip  # the file offset of the mapping's first byte
            blocks = {
                k
                for a, b in live
                if (r := t.local(a, b))
                for k in range(
                    (base + t.skip + r[0] * t.row_bytes) // fold,
                    (base + t.skip + r[1] * t.row_bytes - 1) // fold + 1,
                )
            }
            for address, length in calls:
                if not t.address <= address < t.address + t.end:
                    continue
                lo = base + address - t.address
                hits = set(range(lo // fold, (lo + length - 1) // fold + 1)) & blocks
                if hits:
                    bad.append((t.name, lo, length))

    monkeypatch.setattr(mapped.MappedReader, "_drop_done", checked)
    with anyio.fail_after(60):
        async with AsyncHDF5DataLayer(
            path, batch_size=2**12, chunk_size=2**18, block_size=2**11, shuffle=True, seed=0,
            mmap=True,
        ) as layer:  # fmt: skip
            assert layer.stats.read_paths == {"data": "mmap", "label": "mmap"}
            n = 0
            async for b in layer:
                np.testing.assert_array_equal(b["data"], b.indices * 10)
                n += len(b.indices)
    assert n == 2**21
    assert not bad, bad[:5]


@pytest.mark.parametrize("seed", range(4))
def test_gaps_are_what_no_span_covers(seed: int) -> None:
    """:func:`._spans.gaps` (the pages the mapped reader unmaps) agrees with
    :func:`._spans.uncovered` of the merged spans, on spans that overlap, touch, nest, stick
    out of the range asked about, or are none."""
    from asynchdf5._read._spans import gaps, merged, uncovered

    rng = np.random.default_rng(seed)
    for n in (0, 1, 2, 5, 40):
        lo = rng.integers(-10, 200, n)
        hi = lo + rng.integers(0, 30, n)
        for a, b in ((0, 190), (20, 60), (50, 50)):
            want = uncovered(merged(list(zip(lo.tolist(), hi.tolist(), strict=True))), a, b)
            want = [(x, y) for x, y in want if x < y]
            assert gaps(lo, hi, a, b) == want, (lo, hi, a, b)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the reader is the same on both
async def test_a_page_that_cannot_be_populated_is_a_read_error_naming_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error while a chunk is made ready (``MADV_POPULATE_READ`` answering EIO, faked:
    the chunks after the first, whose pages are populated in spans bridging several of its
    row ranges) is a ReadError naming the file, the top and rows of the chunk, before any of
    its batches."""
    import errno

    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    path = write_h5(tmp_path / "one.h5", 0, N)
    calls: list[int] = []
    madvise = maps.Libc.madvise

    def failing(self: maps.Libc, address: int, length: int, advice: int) -> int:
        if advice == mapped._POPULATE_READ:
            calls.append(length)
            if len(calls) > 2:
                return errno.EIO
        return madvise(self, address, length, advice)

    monkeypatch.setattr(maps.Libc, "madvise", failing)
    seen = set()
    with anyio.fail_after(30), pytest.raises(ReadError) as info:
        async with AsyncHDF5DataLayer(
            path, batch_size=64, chunk_size=1000, block_size=100, shuffle=True, seed=0, mmap=True
        ) as layer:
            assert layer.stats.read_paths["data"] == "mmap"
            async for b in layer:
                seen.update(b.indices.tolist())
    check_message(info.value, path, "read failed", os.strerror(errno.EIO), "top '", "rows ")
    assert len(seen) < N


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the reader is the same on both
async def test_small_rows_close_together_are_populated_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41: a shuffled chunk of 256 blocks of 256 one-byte labels lies spread over the
    label's 1 MiB with gaps far under 64 KiB: its pages are populated in one call (it was a
    call per run of pages, dozens a chunk, thousands an epoch), and every row still arrives
    right, exactly once."""
    monkeypatch.setattr(mapped, "default_keep_bytes", lambda: 0)
    n = 2**20
    path = tmp_path / "small.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.arange(n, dtype=np.int64))
        f.create_dataset("label", data=(np.arange(n) % 251).astype(np.uint8))
    readers: list[Any] = []
    init = mapped.MappedReader.__init__

    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        readers.append(self)

    calls: list[int] = []  # populate calls on the label's mapping, per chunk
    madvise = maps.Libc.madvise

    def counted(self: maps.Libc, address: int, length: int, advice: int) -> int:
        if advice == mapped._POPULATE_READ and readers:
            label = next(t for t in readers[0]._tops if t.name == "label")
            if label.address <= address < label.address + label.end:
                calls[-1] += 1
        return madvise(self, address, length, advice)

    prepare = mapped.MappedReader._prepare

    def per_chunk(self: Any, ranges: list[tuple[int, int]]) -> int:
        calls.append(0)
        return prepare(self, ranges)

    monkeypatch.setattr(mapped.MappedReader, "__init__", recorded)
    monkeypatch.setattr(maps.Libc, "madvise", counted)
    monkeypatch.setattr(mapped.MappedReader, "_prepare", per_chunk)
    seen = np.zeros(n, np.int64)
    with anyio.fail_after(60):
        async with AsyncHDF5DataLayer(
            path, batch_size=2**12, chunk_size=2**16, block_size=2**8, shuffle=True, seed=0,
            mmap=True,
        ) as layer:  # fmt: skip
            assert layer.stats.read_paths == {"data": "mmap", "label": "mmap"}
            async for b in layer:
                np.testing.assert_array_equal(b["data"], b.indices)
                np.testing.assert_array_equal(b["label"], b.indices % 251)
                np.add.at(seen, b.indices, 1)
    assert (seen == 1).all()
    assert len(calls) >= 16 and max(calls) == 1, calls


@pytest.mark.parametrize("mmap", [True, False])
async def test_sparse_rows_of_unsorted_repeated_columns_in_chunks_anywhere_are_h5pys(
    tmp_path: Path, mmap: bool
) -> None:
    """A CSR group whose rows hold their column indices unsorted and repeated (scipy allows
    both: a matrix not in canonical form), empty rows first and last, ``data`` and ``indices``
    in chunks of different sizes written in a shuffled order (no chunk where the one before it
    ends), int32 indices (batches made without scipy's constructor): mapped or copied, two
    shuffled epochs, every sample once, each batch's rows h5py's, value for value in their
    stored order, the ``label`` of the same samples, and the matrix scipy's constructor makes
    of the same arrays (its canonical flags worked out, not assumed; duplicates summed)."""
    import scipy.sparse

    rng = np.random.default_rng(11)
    n, cols = 600, 40
    lengths = rng.integers(0, 25, n)
    lengths[:4] = lengths[-5:] = 0
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    total = int(indptr[-1])
    data = rng.standard_normal(total).astype(np.float32)
    indices = rng.integers(0, cols, total).astype(np.int32)  # unsorted, repeated within rows
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(n)
        g = f.create_group("X")
        g.attrs["shape"] = (n, cols)
        g["indptr"] = indptr
        for name, values, size in (("data", data, 29), ("indices", indices, 17)):
            d = g.create_dataset(name, values.shape, values.dtype, chunks=(size,))
            for k in rng.permutation(-(-total // size)).tolist():
                d[k * size : (k + 1) * size] = values[k * size : (k + 1) * size]
    kw: dict[str, Any] = dict(tops=("X", "label"), shuffle=True, seed=3, chunk_size=256)
    before = await asnapshot()
    with anyio.fail_after(60):
        served, stats = await batches(path, mmap=mmap, **kw)
    await aassert_released(before)
    assert stats.read_paths["X"] == ("sparse-mmap" if mmap else "sparse-chunks")
    for got in served:
        check_exactly_once([b.indices for b in got], n)
        assert all(b.size == 64 for b in got[:-1])
        for b in got:
            x, rows = b["X"], b.indices.tolist()
            np.testing.assert_array_equal(b["label"], b.indices)
            assert x.shape == (len(rows), cols) and x.indptr.dtype == x.indices.dtype == np.int32
            np.testing.assert_array_equal(np.diff(x.indptr), lengths[b.indices])
            pick = np.concatenate([np.arange(indptr[r], indptr[r + 1]) for r in rows])
            np.testing.assert_array_equal(x.data, data[pick])
            np.testing.assert_array_equal(x.indices, indices[pick])
            made = scipy.sparse.csr_array(
                (x.data.copy(), x.indices.copy(), x.indptr.copy()), shape=x.shape
            )
            assert x.has_sorted_indices == made.has_sorted_indices
            assert x.has_canonical_format == made.has_canonical_format
            np.testing.assert_array_equal(x.toarray(), made.toarray())
    assert any(not b["X"].has_sorted_indices for got in served for b in got)  # the case made


@pytest.mark.parametrize("mmap", [True, False])
async def test_shards_of_no_rows_stored_chunked_among_files_are_skipped(
    tmp_path: Path, mmap: bool
) -> None:
    """Shards of no rows first, between and last, their tops chunked (resizable, as a writer
    that appends makes them: an empty chunk index, read as chunks of no chunk) or contiguous
    and never written, beside shards of rows in chunks: mapped or copied, every sample once an
    epoch, each batch's rows the ones written and its label the same samples'."""
    names, start = [], 0
    for i, n in enumerate([0, 700, 0, 0, 313, 0]):
        with h5py.File(tmp_path / f"s{i}.h5", "w") as f:
            for name, arr in rows(start, n).items():  # check_batch's rows
                if n or i % 2:
                    chunks = (8, *arr.shape[1:])
                    f.create_dataset(name, data=arr, chunks=chunks, maxshape=(None, *chunks[1:]))
                else:
                    f.create_dataset(name, arr.shape, arr.dtype)
        names.append(f"s{i}.h5")
        start += n
    (tmp_path / "list.txt").write_text("\n".join(names) + "\n")
    with h5py.File(tmp_path / "s1.h5") as f:  # what the writer made of the shards
        assert f["data"].chunks == (8, 2)
    with h5py.File(tmp_path / "s3.h5") as f:
        assert f["data"].chunks == (8, 2) and f["data"].shape == (0, 2)
    kw: dict[str, Any] = dict(shuffle=True, seed=2, chunk_size=256)
    before = await asnapshot()
    with anyio.fail_after(60):
        served, stats = await batches(tmp_path / "list.txt", mmap=mmap, **kw)
    await aassert_released(before)
    paths = {"data": "mmap", "label": "mmap"} if mmap else {"data": "chunks", "label": "chunks"}
    assert stats.read_paths == paths
    for epoch, got in enumerate(served):
        check_epoch(got, start, 64, epoch)  # each batch's rows and labels: its samples'
