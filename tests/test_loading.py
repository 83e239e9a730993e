"""The reader stage: chunks smaller than a cache slot share one, and no read overwrites rows
still in use.

An epoch's first chunk is read as a ramp of growing pieces (so that the first batch waits for
the first piece only). The pieces together hold one chunk's rows, so they go one after the
other into one cache slot, and the chunk after the ramp is given the other slot without waiting
for a piece to be served. A slot shared so goes back only once every chunk in it is released.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import time
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

import asynchdf5._hdf5
from asynchdf5 import AsyncHDF5DataLayer, ReadError
from asynchdf5._catalog import SHUFFLED_ATTR
from asynchdf5._loading import _Region
from asynchdf5._read import HDF5Reader
from asynchdf5._sources import _direct, _local

from ._files import ROW_BYTES, N, check_epoch, ramp, write_source

pytestmark = pytest.mark.anyio

CHUNK = 64  # rows per chunk: 300 rows make chunks of 64 (the first ramped) and one of 44
BATCH = 4


def _span(arrays: Any) -> list[tuple[int, int]]:
    """The memory each array of ``arrays`` covers: [first byte, past the last)."""
    out = []
    for a in arrays.values():
        start = a.__array_interface__["data"][0]
        out.append((start, start + a.nbytes))
    return out


class _Reads:
    """Records every read of a chunk into a slot (where it went) and checks that it writes no
    row of a chunk still in use."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[int, int, list[tuple[int, int]]]] = []
        self.live: dict[int, list[tuple[int, int]]] = {}  # id(region.slot.arrays): spans
        self.overlaps: list[str] = []
        real_read, real_release = HDF5Reader.read, _Region.release

        async def read(reader: HDF5Reader, chunk: Any, into: Any, stats: Any) -> Any:
            if into is not None:
                spans = _span(into)
                for other in self.live.values():
                    for a, b in spans:
                        if any(a < y and x < b for x, y in other):
                            self.overlaps.append(f"epoch {chunk.epoch} chunk {chunk.index}")
                self.live[id(into)] = spans
                self.reads.append((chunk.epoch, chunk.index, spans))
            return await real_read(reader, chunk, into, stats)

        def release(region: _Region) -> None:
            self.live.pop(id(region.slot.arrays), None)
            real_release(region)

        monkeypatch.setattr(HDF5Reader, "read", read)
        monkeypatch.setattr(_Region, "release", release)


async def _epochs(layer: AsyncHDF5DataLayer, count: int) -> None:
    for epoch in range(count):
        with anyio.fail_after(30):
            batches = [b async for b in layer]
        check_epoch(batches, N, BATCH, epoch)


async def test_ramp_pieces_share_one_slot_and_the_next_chunk_has_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _Reads(monkeypatch)
    source = write_source(tmp_path)[0]
    with ramp(8, lane_rows=2**26):  # a first chunk of 64 rows: pieces of 8, 16 and 40, one lane
        layer = AsyncHDF5DataLayer(
            source, batch_size=BATCH, shuffle=True, seed=5, chunk_size=CHUNK,
            cache_bytes=2 * CHUNK * ROW_BYTES, mmap=False,
        )  # fmt: skip
        async with layer:
            await _epochs(layer, 3)
    # Reads run as tasks of their own, so the chunk after the ramp may start before the last
    # piece does: take them in chunk order.
    first = sorted((r for r in reads.reads if r[0] == 0), key=lambda r: r[1])
    assert [r[1] for r in first] == [0, 1, 2, 3, 4, 5, 6]
    pieces, after = first[:3], first[3]
    # The three pieces lie one after the other in one slot, in each top's array ...
    for top in range(2):
        ends = [r[2][top] for r in pieces]
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(ends))
    # ... so the chunk after the ramp has the other slot (with a slot per piece, it had to
    # wait for the second piece's).
    assert after[2][0][0] not in range(pieces[0][2][0][0], pieces[-1][2][0][1])
    assert not reads.overlaps


@pytest.mark.parametrize("ramp_rows", [None, 1, 3, 8, 20])
@pytest.mark.parametrize("sizes", [(100, 150, 50), (7, 61, 1, 131)])
async def test_no_read_overwrites_rows_still_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ramp_rows: int | None, sizes: tuple[int, ...]
) -> None:
    """Over epochs whose ramps and short last chunks share slots (within an epoch and across
    its end), every read goes into rows no chunk still being served holds, and every epoch
    yields every sample once, aligned."""
    reads = _Reads(monkeypatch)
    source = write_source(tmp_path, sizes)[0]
    with ramp(ramp_rows, lane_rows=2**26):
        layer = AsyncHDF5DataLayer(
            source, batch_size=BATCH, shuffle=True, seed=ramp_rows or 0, chunk_size=CHUNK,
            cache_bytes=2 * CHUNK * ROW_BYTES, prefetch=1, mmap=False,
        )  # fmt: skip
        async with layer:
            n = sum(sizes)
            for epoch in range(4):
                with anyio.fail_after(30):
                    batches = [b async for b in layer]
                    await anyio.sleep(0)
                check_epoch(batches, n, BATCH, epoch)
    assert len(reads.reads) >= 4 * -(-sum(sizes) // CHUNK)
    assert not reads.overlaps, reads.overlaps


@pytest.mark.parametrize("how", ["O_DIRECT", "refused", "in order", "packed shuffled"])
async def test_data_larger_than_memory_is_read_around_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Where the data outgrows the memory the process may use, the reader reads around the
    page cache: shuffled, ``O_DIRECT``, or where the file system refuses it, advice before and
    after each read; in order, through the kernel's read-ahead, dropped after, and so is data
    packed shuffled read shuffled (its chunks are stretches, read as in order). The epochs are
    as exact; data that fits reads as before."""
    direct = how == "O_DIRECT"
    # Shuffled in blocks of 8 rows, a chunk is read from 8 places (rows this narrow make the
    # default blocks as long as a chunk: one stretch each, read as in order).
    scattered = ("O_DIRECT", "refused")
    calls: list[object] = []
    real_read, real_advise = _direct.read_direct, _direct.advise

    def read_direct(*args: Any) -> bool:
        calls.append("direct")
        return real_read(*args)

    def advise(fd: int, offset: int, size: int, what: int | None) -> None:
        calls.append(what)
        real_advise(fd, offset, size, what)

    monkeypatch.setattr(_local, "read_direct", read_direct)
    monkeypatch.setattr(_local, "advise", advise)
    monkeypatch.setattr(_local, "DIRECT_MIN", 0)  # the test's rows are a few bytes
    if how == "refused":  # as a file system that refuses O_DIRECT would
        monkeypatch.setenv("ASYNCHDF5_DIRECT", "0")
    source, paths = write_source(tmp_path)
    if how == "packed shuffled":  # as `asynchdf5 pack --shuffle` marks its files
        for path in paths:
            with h5py.File(path, "r+") as f:
                f.attrs[SHUFFLED_ATTR] = True
    for memory, streams in ((N * ROW_BYTES - 1, True), (N * ROW_BYTES, False)):
        calls.clear()
        monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda memory=memory: memory)
        layer = AsyncHDF5DataLayer(
            source, batch_size=BATCH, shuffle=how != "in order", seed=3, chunk_size=CHUNK,
            cache_bytes=2 * CHUNK * ROW_BYTES, block_size=8 if how in scattered else None,
        )  # fmt: skip
        async with layer:
            await _epochs(layer, 2)
        if not streams:
            assert not calls
        elif direct:
            assert set(calls) == {"direct"}
        elif how == "refused":
            assert {_direct.WILLNEED, _direct.DONTNEED} == set(calls)
        else:
            assert {_direct.DONTNEED} == set(calls)


@pytest.mark.parametrize("shuffle", [True, False])
async def test_a_sparse_top_larger_than_memory_streams_by_its_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """Whether data outgrows memory is a question of its bytes: a sparse top's values and
    column indices, not the spans a slot keeps of its rows (16 bytes a row). A CSR matrix whose
    values exceed the memory the process may use streams (read around the page cache, more reads
    in flight where shuffled) though its spans fit many times over; one that fits does not; the
    epochs are exact and every row holds its own values either way."""
    rng = np.random.default_rng(0)
    rows, cols = 400, 64
    lengths = rng.integers(10, 30, rows)
    indptr = np.concatenate(([0], np.cumsum(lengths)))
    indices = np.concatenate([np.sort(rng.choice(cols, k, replace=False)) for k in lengths])
    path = tmp_path / "cells.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g["data"] = np.repeat(np.arange(rows, dtype=np.float32), lengths)  # row i holds i's
        g["indices"], g["indptr"] = indices.astype(np.int32), indptr
        g.attrs["shape"], g.attrs["encoding-type"] = (rows, cols), "csr_matrix"
        f["label"] = np.arange(rows)
    values_bytes = int(indptr[-1]) * 8 + rows * 8  # values, column indices, labels
    made: list[str | None] = []
    real_init = HDF5Reader.__init__

    def init(reader: HDF5Reader, *args: Any, **kw: Any) -> None:
        real_init(reader, *args, **kw)
        made.append(reader.streaming)

    monkeypatch.setattr(HDF5Reader, "__init__", init)
    for memory in (values_bytes // 2, 4 * values_bytes):  # spans and labels: 24 bytes a row
        monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda memory=memory: memory)
        layer = AsyncHDF5DataLayer(
            str(path), tops=("X", "label"), batch_size=16, shuffle=shuffle, seed=1,
            chunk_size=100, block_size=10, mmap=False,
        )  # fmt: skip
        async with layer:
            for _ in range(2):
                with anyio.fail_after(30):
                    batches = [b async for b in layer]
                ids = np.concatenate([b.indices for b in batches])
                assert sorted(ids.tolist()) == list(range(rows))
                for b in batches:
                    x = b["X"]
                    assert (b["label"] == b.indices).all()
                    np.testing.assert_array_equal(x.data, np.repeat(b.indices, lengths[b.indices]))
                    np.testing.assert_array_equal(
                        x.indices,
                        np.concatenate([indices[indptr[i] : indptr[i + 1]] for i in b.indices]),
                    )
    assert made == ["scattered" if shuffle else "in order", None]


async def test_a_file_truncated_under_direct_reads_is_a_read_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, paths = write_source(tmp_path)
    monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda: N * ROW_BYTES - 1)
    monkeypatch.setattr(_local, "DIRECT_MIN", 0)
    layer = AsyncHDF5DataLayer(
        source, batch_size=BATCH, shuffle=False, chunk_size=CHUNK,
        cache_bytes=2 * CHUNK * ROW_BYTES,
    )  # fmt: skip
    with pytest.raises(ReadError, match=r"part1\.h5.*truncated"):
        with anyio.fail_after(30):
            async with layer:
                os.truncate(paths[1], 4096)
                async for _ in layer:
                    pass


async def test_a_file_system_refusing_direct_reads_falls_back_on_every_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that opens with ``O_DIRECT`` but refuses the reads (``EINVAL``): the file is
    read through the page cache from then on, by every reading thread, the descriptor still open
    for those already reading from it (closing it at the first refusal failed the others' reads
    with EBADF)."""
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            time.sleep(0.002)  # widen the window: other threads take the descriptor meanwhile
            fcntl.fcntl(fd, fcntl.F_GETFL)  # EBADF, as the read would be, if it was closed
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    n = 40_000  # rows of 1 KiB: chunks of 16 MiB, read by several threads at once
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.repeat(np.arange(n, dtype=np.int64), 128).reshape(n, 128))
        f.create_dataset("label", data=np.arange(n, dtype=np.int64))
    monkeypatch.setattr(asynchdf5._hdf5, "memory_bytes", lambda: n * 1032 - 1)
    layer = AsyncHDF5DataLayer(
        [str(path)], batch_size=256, shuffle=True, seed=1, chunk_size=16384, block_size=64
    )
    async with layer:
        for _ in range(2):
            seen = []
            with anyio.fail_after(60):
                async for b in layer:
                    np.testing.assert_array_equal(b["data"][:, 0], b["label"])
                    np.testing.assert_array_equal(b["label"], b.indices)
                    seen.append(b.indices)
            np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(n))


@pytest.mark.parametrize(("cores", "threads"), [(1, 2), (2, 2), (16, 8)])
@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
async def test_a_resident_data_set_is_read_in_on_a_thread_a_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, threads: int, layout: str
) -> None:
    """Read once into memory never written before, a resident data set costs CPU more than
    disk: it is read on as many threads as cores (2 to 8), streaming chunks on 2, and either
    way every row arrives exactly once with its values."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    made: list[tuple[bool, float]] = []
    real_init = HDF5Reader.__init__

    def init(reader: HDF5Reader, *args: Any, **kw: Any) -> None:
        real_init(reader, *args, **kw)
        made.append((reader.resident is not None, reader._limiter.total_tokens))

    monkeypatch.setattr(HDF5Reader, "__init__", init)
    source, _ = write_source(tmp_path, layout=layout)
    for chunk_size in (2**20, CHUNK):  # resident, then streaming
        with anyio.fail_after(30):
            layer = AsyncHDF5DataLayer(
                source, batch_size=BATCH, shuffle=True, seed=2, chunk_size=chunk_size, mmap=False
            )
            async with layer:
                for epoch in range(2):
                    check_epoch([b async for b in layer], N, BATCH, epoch)
    assert made == [(True, threads), (False, 2)]
