"""Descriptors of a local source: thousands of files under a low ``ulimit -n``, a bounded number
open at once, files closed and opened again checked against the catalog's fingerprints."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import asynchdf5._hdf5
from asynchdf5 import AsyncHDF5DataLayer, Batch, ReadError, SourceError
from asynchdf5._sources import LocalSource, _handles

from ._files import LAYOUTS, check_epoch, check_message, write_h5
from .test_faults import rewrite_in_place

ROOT = Path(__file__).resolve().parent.parent


def write_many(folder: Path, count: int, rows: int, layout: str = "contiguous") -> Path:
    """``count`` files of ``rows`` samples each, and a list file naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        names.append(write_h5(folder / f"s{i:05d}.h5", i * rows, rows, layout=layout).name)
    lst = folder / "train.txt"
    lst.write_text("\n".join(names) + "\n")
    return lst


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def few_open(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Sources made during the test keep at most 3 files open."""
    monkeypatch.setattr(_handles, "MAX_OPEN_FILES", 3)
    yield 3


async def _epoch(layer: AsyncHDF5DataLayer, most_fds: list[int]) -> list[Batch]:
    got = []
    async for b in layer:
        got.append(b)
        most_fds[0] = max(most_fds[0], _fds())
    return got


@pytest.fixture(scope="module")
def thousands(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 files of 3 samples, written once for the module; each test reads a copy (new
    files: nothing a run keeps beside them, such as its catalog, reaches the next)."""
    return write_many(tmp_path_factory.mktemp("thousands"), 3000, 3).parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE and /proc")
@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streaming"])
def test_thousands_of_files_under_a_low_descriptor_limit(
    tmp_path: Path, thousands: Path, streaming: bool
) -> None:
    """3,000 files, ``ulimit -n 256``: two shuffled epochs, each exactly once (in a child that
    lowers its own limit). Streaming (data larger than memory, every range read direct), each
    open file holds a third descriptor."""
    lst = Path(shutil.copytree(thousands, tmp_path / "files")) / "train.txt"
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        import anyio
        import asynchdf5._hdf5
        import asynchdf5._sources._local
        from asynchdf5 import AsyncHDF5DataLayer
        from tests._files import check_epoch

        if {streaming!r}:
            asynchdf5._hdf5.memory_bytes = lambda: 1
            asynchdf5._sources._local.DIRECT_MIN = 0

        async def main():
            with anyio.fail_after(60):
                layer = AsyncHDF5DataLayer(
                    {str(lst)!r}, batch_size=64, shuffle=True, seed=3, chunk_size=1024
                )
                async with layer:
                    for epoch in range(2):
                        got = [b async for b in layer]
                        check_epoch(got, 9000, 64, epoch)
            print("OK")

        anyio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "OK", out.stdout + out.stderr


@pytest.mark.anyio
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streaming"])
@pytest.mark.parametrize("layout", ["contiguous", "gzip", "gzip-split", "scaleoffset"])
async def test_files_closed_and_opened_again_read_exactly_once(
    tmp_path: Path, few_open: int, layout: str, streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read path, with 3 files kept open of 12: the descriptors stay bounded, and the
    files closed in between are opened again for later chunks and epochs. Streaming (data
    larger than memory), an open file has an O_DIRECT descriptor too, closed with it."""
    if streaming:
        monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda: 1)
    lst = write_many(tmp_path, 12, 25, layout)
    before = _fds()
    most = [before]
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            lst, batch_size=10, shuffle=True, seed=1, chunk_size=40, mmap=False
        ) as layer:
            assert layer.stats.read_paths["data"] == LAYOUTS[layout]
            for epoch in range(2):
                check_epoch(await _epoch(layer, most), 300, 10, epoch)
    # Each open file: our descriptor and h5py's (and streaming, the direct one); a few more for
    # the layer's threads and pipes.
    assert most[0] - before <= (3 if streaming else 2) * few_open + 8, (before, most[0])


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["rewritten", "deleted"])
@pytest.mark.parametrize("layout", ["contiguous", "scaleoffset"])
async def test_a_file_changed_while_closed_is_a_read_error_when_opened_again(
    tmp_path: Path, few_open: int, layout: str, fault: str
) -> None:
    """Kept open, a deleted file would still be read (from its descriptor); closed in between,
    it cannot be, and a rewritten one must not be: both are named errors."""
    lst = write_many(tmp_path, 8, 20, layout)
    victim = tmp_path / "s00003.h5"  # not in the next epoch's first chunk (read already)
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(lst, batch_size=10, chunk_size=20, mmap=False) as layer:
            check_epoch([b async for b in layer], 160, 10, 0)  # the early files are closed now
            if fault == "rewritten":
                rewrite_in_place(victim)  # size and modification time kept
            else:
                victim.unlink()
            with pytest.raises(ReadError) as info:
                async for _ in layer:
                    pass
    # ... naming the list file's line that named it (issue 39, item 10).
    check_message(
        info.value, victim, "changed since the layer opened it", "rows 0:20", "train.txt, line 4"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE")
def test_out_of_descriptors_counts_the_files_really_held(tmp_path: Path) -> None:
    """With every descriptor taken and none to give back, opening another file says how many
    the source holds."""
    paths = [write_h5(tmp_path / f"f{i}.h5", i * 5, 5) for i in range(4)]
    code = textwrap.dedent(
        f"""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        from asynchdf5 import SourceError
        from asynchdf5._sources import LocalSource
        paths = {[str(p) for p in paths]!r}
        source = LocalSource()
        held = [source.open(p) for p in paths[:3]]
        for f in held:
            f.pin()  # in use: never closed to make room
        spare = []
        try:
            while True:
                spare.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        try:
            source.open(paths[3])
        except SourceError as exc:
            print(exc)
        finally:
            for fd in spare:
                os.close(fd)
            for f in held:
                f.unpin()
            source.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check_message(
        SourceError(out.stdout), paths[3], "no more files", "holds 3 files open, 3 of them in use"
    )


def test_the_least_recently_used_file_not_pinned_is_closed(tmp_path: Path) -> None:
    paths = [str(write_h5(tmp_path / f"f{i}.h5", i * 5, 5)) for i in range(6)]
    source = LocalSource(max_open=2)
    try:
        first = source.open(paths[0])
        fd = first.pin()  # a read in flight
        others = [source.open(p) for p in paths[1:]]
        assert first.fd == fd
        os.fstat(fd)  # still open: never closed under its read
        assert [f.fd >= 0 for f in others] == [False, False, False, False, True]
        first.unpin()
        first.check()  # still open, and now the most recently used
        others[0].check()  # opened again, checked against its catalogued fingerprint
        assert (first.fd >= 0, others[0].fd >= 0, others[-1].fd >= 0) == (True, True, False)
        with others[1].pinned():
            assert others[1].h5py_file()["label"][0] == 10
        assert (first.fd >= 0, others[0].fd >= 0) == (False, True)
    finally:
        source.close()
    assert all(f.fd == -1 for f in [first, *others])


def test_threads_pinning_files_never_meet_a_closed_descriptor(tmp_path: Path) -> None:
    """Eight threads pin, read and unpin twenty files through three slots: every read sees its
    own file's bytes, and no more files are open than the slots and the pins in flight."""
    paths = [str(write_h5(tmp_path / f"f{i}.h5", i * 5, 5)) for i in range(20)]
    heads = [Path(p).read_bytes()[:4096] for p in paths]
    source = LocalSource(max_open=3)
    files = [source.open(p) for p in paths]
    errors: list[BaseException] = []
    most = [0]

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.randrange(len(files))
                with files[k].pinned():
                    assert os.pread(files[k].fd, 4096, 0) == heads[k]
                    held = sum(f.fd >= 0 for f in files)
                    most[0] = max(most[0], held)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    source.close()
    assert not errors, errors[0]
    assert most[0] <= 3 + 8
    assert all(f.fd == -1 for f in files)


@pytest.mark.anyio
async def test_a_mapped_file_stays_open_among_files_closed_to_make_room(
    tmp_path: Path, few_open: int
) -> None:
    """``mmap=True`` on a source whose file with rows was closed to make room for empty ones:
    the mapped reader opens it again and keeps it pinned (never closed under its mapping)."""
    data = write_h5(tmp_path / "data.h5", 0, 300)
    empty = [write_h5(tmp_path / f"empty{i}.h5", 300, 0) for i in range(4)]
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            [data, *empty], batch_size=10, shuffle=True, seed=0, chunk_size=100, mmap=True
        ) as layer:
            assert layer.stats.read_paths["data"] == "mmap"
            for epoch in range(2):
                check_epoch([b async for b in layer], 300, 10, epoch)
