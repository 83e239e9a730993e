"""The source property (list files, paths and URLs resolved once, at construction), and the
local source's reads and closed state."""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, DataLayerError, ReadError, SchemaError, SourceError
from asynchdf5._gathering import leaf
from asynchdf5._sources import _local, resolve_source
from asynchdf5._sources._base import ByteRange
from asynchdf5._stats import ReadStats

from ._files import check_message, write_h5

pytestmark = pytest.mark.anyio


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A working directory to change into (restored after the test)."""
    cwd = os.getcwd()
    other = tmp_path / "elsewhere"
    other.mkdir()
    try:
        yield other
    finally:
        os.chdir(cwd)


def _files(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [write_h5(folder / "a.h5", 0, 30), write_h5(folder / "b.h5", 30, 20)]


async def test_relative_paths_are_resolved_at_construction(tmp_path: Path, elsewhere: Path) -> None:
    data = tmp_path / "data"
    _files(data)
    (data / "train.txt").write_text("a.h5\nb.h5\n")
    os.chdir(tmp_path)
    by_list = AsyncHDF5DataLayer(Path("data/train.txt"), batch_size=10)
    by_paths = AsyncHDF5DataLayer(["data/a.h5", Path("data/b.h5")], batch_size=10)
    one = AsyncHDF5DataLayer("data/a.h5", batch_size=10)
    os.chdir(elsewhere)  # later changes of the working directory change nothing
    for layer, n in ((by_list, 50), (by_paths, 50), (one, 30)):
        async with layer:
            assert sum([len(b.indices) async for b in layer]) == n


@pytest.mark.parametrize(
    ("encoding", "newline"),
    [("utf-8-sig", "\r\n"), ("utf-8-sig", "\n"), ("utf-8", "\r\n"), ("utf-8", "\r")],
    ids=["bom-crlf", "bom-lf", "crlf", "cr"],
)
def test_list_file_with_a_bom_or_crlf(tmp_path: Path, encoding: str, newline: str) -> None:
    a, b = _files(tmp_path)
    lst = tmp_path / "train.txt"
    lst.write_bytes(newline.join(["# files", "a.h5", "", "  b.h5  ", ""]).encode(encoding))
    assert resolve_source(lst) == [str(a), str(b)]


def test_an_hdf5_file_is_a_one_file_source(tmp_path: Path) -> None:
    a, _ = _files(tmp_path)
    assert resolve_source(a) == [str(a)]


def test_a_missing_path_is_not_called_a_list_file(tmp_path: Path) -> None:
    missing = tmp_path / "train.h5"
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(missing, batch_size=4)
    check_message(info.value, missing, "does not exist", "an HDF5 file")
    assert f"list file {str(missing)!r}" not in str(info.value)


def test_a_file_that_is_neither_is_named_as_such(tmp_path: Path) -> None:
    junk = tmp_path / "train.bin"
    junk.write_bytes(b"\x00\xff" * 100)
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(junk, batch_size=4)
    check_message(info.value, junk, "neither an HDF5 file nor a source list file")


def test_urls_are_kept_as_urls(tmp_path: Path) -> None:
    lst = tmp_path / "train.txt"
    lst.write_text("s3://bucket/a.h5\nlocal.h5\n")
    assert resolve_source(lst) == ["s3://bucket/a.h5", str(tmp_path / "local.h5")]
    assert resolve_source("memory://x/y.h5") == ["memory://x/y.h5"]


def test_a_listed_path_is_relative_to_the_list_not_the_working_directory(
    tmp_path: Path, elsewhere: Path
) -> None:
    _files(tmp_path / "sub")
    lst = tmp_path / "sub" / "train.txt"
    lst.write_text("a.h5\n../sub/b.h5\n")
    os.chdir(elsewhere)
    assert resolve_source(lst) == [str(tmp_path / "sub" / "a.h5"), str(tmp_path / "sub" / "b.h5")]


def test_a_file_url_source_is_a_local_path(tmp_path: Path) -> None:
    a, b = _files(tmp_path)
    (tmp_path / "train.txt").write_text("a.h5\nb.h5\n")
    assert resolve_source((tmp_path / "train.txt").as_uri()) == [str(a), str(b)]
    assert resolve_source(a.as_uri()) == [str(a)]


def test_a_url_named_like_hdf5_is_not_read_at_construction() -> None:
    # Nothing there, and no request made: it is checked when the layer opens.
    assert resolve_source("s3://no-such-bucket/x/data.h5") == ["s3://no-such-bucket/x/data.h5"]
    assert resolve_source("gs://b/y.hdf5?generation=1") == ["gs://b/y.hdf5?generation=1"]


@pytest.mark.both_backends
async def test_a_cancelled_fetch_never_leaves_a_read_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fetch's task is cancelled when its run stops (the consumer left, another read failed);
    # its chunk's slot is then given up and refilled. A read started for it must have ended by
    # the time the task is gone: anything else writes into another chunk's rows.
    events: list[str] = []
    lock = threading.Lock()

    def slow_read(batch: Any, work: Any, raws: Any, streaming: bool) -> None:
        with lock:
            events.append("start")
        time.sleep(0.2)
        with lock:
            events.append("end")

    monkeypatch.setattr(_local, "_fetch", slow_read)
    limiter = anyio.CapacityLimiter(2)
    nothing: Any = None  # no decode pool: the read is a stand-in
    with ThreadPoolExecutor(2) as readers:
        for delay in (0, 0, 0.05):

            async def cancel(tg: anyio.abc.TaskGroup, delay: float = delay) -> None:
                await anyio.sleep(delay)
                tg.cancel_scope.cancel()

            events.clear()
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        _local.LocalSource._fetch_in_thread,
                        [],
                        nothing,
                        limiter,
                        readers,
                        _local.RawBuffers(),
                    )
                    tg.start_soon(cancel, tg)
            with lock:
                assert events in ([], ["start", "end"]), (delay, events)


async def test_a_closed_local_source_refuses_to_open_or_read(tmp_path: Path) -> None:
    # Before, a fetch after close() made a new read pool that nobody shut down, and reopened
    # nothing: the files were gone. Now both are errors naming what was asked, and no thread
    # outlives the source.
    path = write_h5(tmp_path / "a.h5", 0, 30)
    source = _local.LocalSource()
    file = source.open(str(path))
    into = memoryview(bytearray(8))
    work: Executor = ThreadPoolExecutor(1)
    limiter = anyio.CapacityLimiter(2)
    with anyio.fail_after(10):
        await source.fetch(
            [ByteRange(file, 0, 8, "the signature", into)], work, limiter, ReadStats()
        )
    assert bytes(into) == b"\x89HDF\r\n\x1a\n"
    source.close()
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ReadError, match=r"a\.h5: the signature: cannot read: the source is closed"):
        with anyio.fail_after(10):
            await source.fetch(
                [ByteRange(file, 0, 8, "the signature", into)], work, limiter, ReadStats()
            )
    with pytest.raises(SourceError, match=r"cannot open .*a\.h5'?: the source is closed"):
        source.open(str(path))
    work.shutdown()
    assert not any(
        t.name.startswith("asynchdf5-read") for t in threading.enumerate() if t.name not in before
    )


async def test_raw_reads_reuse_their_buffers_and_give_each_then_its_own_bytes(
    tmp_path: Path,
) -> None:
    # Ranges read for their `then` (stored chunks to decode) were read into fresh memory each,
    # whose first touch cost as much CPU as the read. Now a source reuses the buffers once each
    # `then` has returned: every `then` must still see its own range's bytes, however many are
    # in flight, and a range past the end of the file is still named truncated.
    path = tmp_path / "raw.bin"
    data = np.random.default_rng(0).integers(0, 256, 128 * 1024, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    source = _local.LocalSource()
    file = source.open(str(path), hdf5=False)
    seen: dict[int, bytes] = {}
    buffers: set[int] = set()
    lock = threading.Lock()

    def keep(at: int) -> Any:
        def then(raw: bytes | memoryview) -> None:
            assert isinstance(raw, memoryview)
            time.sleep(0.001)  # let reads run ahead of the `then`s
            with lock:
                seen[at] = bytes(raw)
                buffers.add(id(raw.obj))

        return then

    sizes = [1000 + 37 * i for i in range(40)]
    starts = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
    work: Executor = ThreadPoolExecutor(2)
    limiter = anyio.CapacityLimiter(2)
    try:
        for _ in range(2):  # the second pass takes only buffers the first gave back
            seen.clear()
            ranges = [
                ByteRange(file, at, n, f"range {at}", then=keep(at))
                for at, n in zip(starts, sizes, strict=True)
            ]
            with anyio.fail_after(10):
                await source.fetch(ranges, work, limiter, ReadStats())
            assert seen == {at: data[at : at + n] for at, n in zip(starts, sizes, strict=True)}
        assert len(buffers) == len(sizes)  # the second pass made none
        past = [ByteRange(file, len(data) - 10, 20, "the last rows", then=keep(-1))]
        with pytest.raises(BaseException) as caught:  # the fetch's task group wraps it
            with anyio.fail_after(10):
                await source.fetch(past, work, limiter, ReadStats())
        error = leaf(caught.value)
        assert isinstance(error, ReadError)
        assert re.search(r"raw\.bin: the last rows: .*truncated", str(error)), error
        assert -1 not in seen
    finally:
        source.close()
        work.shutdown()


async def test_a_fetch_racing_close_is_a_read_error(tmp_path: Path) -> None:
    # close() shut the read pool down after this fetch took it: the submit is refused, and that
    # must be the named error, not the pool's bare RuntimeError.
    source = _local.LocalSource()
    file = source.open(str(write_h5(tmp_path / "a.h5", 0, 30)))
    readers = ThreadPoolExecutor(1)
    readers.shutdown()
    nothing: Any = None  # the read is refused before it needs a decode pool
    batch = [ByteRange(file, 0, 8, "the signature", memoryview(bytearray(8)))]
    with pytest.raises(ReadError, match=r"a\.h5: the signature: cannot read: the source is closed"):
        with anyio.fail_after(10):
            await _local.LocalSource._fetch_in_thread(
                batch, nothing, anyio.CapacityLimiter(1), readers, _local.RawBuffers()
            )
    source.close()


@pytest.mark.parametrize("race", ["close", "open"])
def test_an_open_that_loses_a_race_keeps_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    # While one open() checks its file, the source is closed (an error: nobody would close the
    # file) or another open() of the same name wins (the winner's file is returned). Either way
    # the loser's descriptor is closed.
    path = str(write_h5(tmp_path / "a.h5", 0, 30))
    source = _local.LocalSource()
    real = _local.is_hdf5_file_fd
    fds: list[int] = []

    def meanwhile(fd: int) -> bool:
        if not fds:
            fds.append(fd)
            if race == "close":
                source.close()
            else:
                source.open(path)  # the other thread, first to finish
        return real(fd)

    monkeypatch.setattr(_local, "is_hdf5_file_fd", meanwhile)
    if race == "close":
        with pytest.raises(SourceError, match=r"cannot open .*a\.h5'?: the source is closed"):
            source.open(path)
    else:
        assert source.open(path) is source.open(path)
        assert source.open(path).fd != fds[0]
    with pytest.raises(OSError):
        os.fstat(fds[0])
    source.close()


# --- errors about an entry say where the source named it ---------------------------------------


async def _open_error(source: Any) -> BaseException:
    with pytest.raises(DataLayerError) as info:
        with anyio.fail_after(30):
            async with AsyncHDF5DataLayer(source, batch_size=10):
                pytest.fail("the layer opened")
    return info.value


async def test_a_missing_file_names_the_list_file_and_line(tmp_path: Path) -> None:
    _files(tmp_path)
    lst = tmp_path / "train.txt"
    lst.write_text("# the training set\na.h5\nb_missing.h5\n")
    err = await _open_error(lst)
    assert isinstance(err, SourceError)
    check_message(err, tmp_path / "b_missing.h5", "does not exist", "(train.txt, line 3)")


@pytest.mark.parametrize("bad", ["not an HDF5 file", "is a directory"])
async def test_a_bad_entry_names_the_list_file_and_line(tmp_path: Path, bad: str) -> None:
    _files(tmp_path)
    if bad == "is a directory":
        (tmp_path / "c.h5").mkdir()
    else:
        (tmp_path / "c.h5").write_bytes(b"not an HDF5 file\n" * 50)
    lst = tmp_path / "train.txt"
    lst.write_text("a.h5\n\n  c.h5\nb.h5\n")
    err = await _open_error(lst)
    assert isinstance(err, SourceError)
    check_message(err, tmp_path / "c.h5", bad, "(train.txt, line 3)")


async def test_a_schema_mismatch_names_the_line_of_the_file_that_differs(tmp_path: Path) -> None:
    write_h5(tmp_path / "a.h5", 0, 30)
    write_h5(tmp_path / "b.h5", 30, 20, label=np.arange(20, dtype=np.float32))
    lst = tmp_path / "train.txt"
    lst.write_text("a.h5\nb.h5\n")
    err = await _open_error(lst)
    assert isinstance(err, SchemaError)
    check_message(err, tmp_path / "b.h5", "top 'label'", "(train.txt, line 2)")


async def test_a_bad_entry_of_a_sequence_names_its_index(tmp_path: Path) -> None:
    a, _ = _files(tmp_path)
    err = await _open_error([a, tmp_path / "gone.h5"])
    check_message(err, tmp_path / "gone.h5", "does not exist", "(source[1])")


def test_entries_remember_their_line_through_copies_and_pickles(tmp_path: Path) -> None:
    _files(tmp_path)
    lst = tmp_path / "train.txt"
    lst.write_text("# files\na.h5\nb.h5\n")
    entries = pickle.loads(pickle.dumps(list(resolve_source(lst))))
    assert entries == [str(tmp_path / "a.h5"), str(tmp_path / "b.h5")]
    assert [e.where for e in entries] == ["train.txt, line 2", "train.txt, line 3"]
    # Resolved again as a sequence (as the torch adapter's workers do): still the list's lines.
    again = resolve_source(entries)
    assert [getattr(e, "where", None) for e in again] == ["train.txt, line 2", "train.txt, line 3"]


def test_raw_buffers_hand_out_the_smallest_kept_buffer_that_fits() -> None:
    """Kept buffers go back out smallest first among those that hold the bytes asked for (a new
    one when none does), each once, and no more bytes are kept than ``keep``."""
    raws = _local.RawBuffers(keep=110)
    kept = [bytearray(n) for n in (40, 10, 30, 10, 20)]
    for buf in kept:
        raws.give(buf)
    raws.give(bytearray(1))  # past ``keep``: not kept

    def taken(size: int) -> int | None:  # which kept buffer a take hands out (None: a new one)
        buf = raws.take(size)
        assert len(buf) >= size
        return next((i for i, k in enumerate(kept) if k is buf), None)

    assert taken(25) == 2  # 30 is the smallest of 30 and 40
    assert taken(10) == 1  # the first of the two 10s given
    assert taken(10) == 3
    assert taken(41) is None  # none holds 41
    assert taken(0) == 4
    assert taken(1) == 0
    assert taken(1) is None  # every kept one handed out once
    raws.give(kept[0])
    raws.clear()
    assert taken(1) is None


def test_pread_into_fills_the_view_or_says_where_the_file_ended(tmp_path: Path) -> None:
    """Every reader of whole ranges (local sources, the remote cache, the helper process's long
    messages, pack's scratch files, bench's raw read) reads through ``pread_into``: the bytes at
    the offset, the count short only where the file ends, an OSError of the read itself raised."""
    from asynchdf5._fileio import pread_into

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(4096)
        assert pread_into(fd, memoryview(buf), 1000) == 4096
        assert buf == (bytes(range(256)) * 40)[1000:5096]
        assert pread_into(fd, memoryview(buf), 8192) == 2048  # the file ends first
        assert buf[:2048] == (bytes(range(256)) * 40)[8192:]
        assert pread_into(fd, memoryview(buf), 20_000) == 0
        assert pread_into(fd, memoryview(bytearray(0)), 0) == 0
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError):  # a pipe cannot be read at an offset
            pread_into(r, memoryview(bytearray(8)), 0)
    finally:
        os.close(r)
        os.close(w)
