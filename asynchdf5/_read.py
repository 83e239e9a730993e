"""Chunk reader: fills a cache slot with the rows of a chunk, for all tops.

Two paths, chosen per file and top when the catalog is built:

* ``pread``: contiguous, uncompressed, native-dtype data is read with ``os.preadv`` straight into
  the slot, outside h5py's process-wide lock, so nobody else's h5py call waits on the loader.
* ``chunks``: chunked (and compressed) data whose filters :mod:`._codecs` decodes: the stored
  chunks are read with ``os.pread`` and decoded by a pool of threads, outside h5py's lock.
* ``h5py``: everything else (chunks that split samples, unsupported filters, other byte orders,
  unallocated or external storage) is read with ``Dataset.read_direct``. **This holds h5py's
  lock** for the call, so reads are cut into pieces of at most ``PIECE_BYTES``.

All functions here block: the pipeline runs them in worker threads.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import h5py
import numpy as np

from ._batch import LoadedChunk
from ._cache import Slot
from ._catalog import Catalog, FileInfo, Layout, Segment
from ._codecs import ChunkDecoder
from ._errors import ReadError
from ._plan import ChunkPlan

if TYPE_CHECKING:
    from ._pipeline import Stats

__all__ = ["PIECE_BYTES", "HDF5Reader", "HDF5Source", "ReadItem"]

#: Largest read done in one call: bounds how long a read holds a thread (and, on the h5py path,
#: h5py's lock), so cancellation and other h5py users are never held up for long.
PIECE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class ReadItem:
    """Rows ``row_start:row_stop`` of ``top`` in ``file``, to land at ``out_start`` of the slot."""

    top: str
    file: FileInfo
    row_start: int
    row_stop: int
    out_start: int

    def describe(self) -> str:
        return f"{self.file.path}: top {self.top!r}, rows {self.row_start}:{self.row_stop}"


class HDF5Reader:
    """Reads chunks of a catalogued source into slots.

    Raw HDF5 chunks are read and decoded by a pool of ``threads`` worker threads, created on
    first use and joined by :meth:`close`.
    """

    def __init__(self, catalog: Catalog, threads: int | None = None) -> None:
        self.catalog = catalog
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._decoders: dict[tuple[int, str], ChunkDecoder] = {}
        paths: dict[str, set[str]] = {t: set() for t in catalog.tops}
        notes: dict[str, set[str]] = {t: set() for t in catalog.tops}
        for f in catalog.files:
            if f.nrows == 0:
                continue
            for top, layout in f.layouts.items():
                paths[top].add(layout.path)
                if layout.note:
                    notes[top].add(layout.note)
        #: Read path of each top: "pread", "chunks" or "h5py" ("+"-joined when files differ).
        self.read_paths = {t: "+".join(sorted(p)) or "none" for t, p in paths.items()}
        #: Why a top falls back to h5py, when it does.
        self.notes = {t: "; ".join(sorted(n)) for t, n in notes.items() if n}

    def items(self, chunk: ChunkPlan) -> list[ReadItem]:
        """The reads that fill a slot with ``chunk``, each about ``PIECE_BYTES`` at most.

        On the ``chunks`` path, pieces end on HDF5 chunk boundaries, so that no stored chunk is
        decoded twice for one slot.
        """
        placed = []
        out = 0
        for a, b in chunk.ranges:
            placed.append((a, b, out))
            out += b - a
        return self.items_for(placed)

    def items_for(self, ranges: Sequence[tuple[int, int, int]]) -> list[ReadItem]:
        """The reads of global indices ``start:stop`` landing at ``out``, per ``(start, stop,
        out)``."""
        segments: list[Segment] = []
        for a, b, out in ranges:
            segments.extend(self.catalog.segments(a, b, out))
        items = []
        for top, info in self.catalog.tops.items():
            piece = max(1, PIECE_BYTES // max(1, info.row_bytes))
            for seg in segments:
                layout = seg.file.layouts[top]
                align = layout.chunk_rows if layout.chunks is not None else None
                # Per segment: files of one top may be chunked differently, or not at all.
                step = max(align, piece // align * align) if align else piece
                r = seg.row_start
                while r < seg.row_stop:
                    r1 = min(seg.row_stop, (r // step + 1) * step if align else r + step)
                    items.append(ReadItem(top, seg.file, r, r1, seg.out_start + r - seg.row_start))
                    r = r1
        return items

    def read(self, items: Sequence[ReadItem], slot: dict[str, np.ndarray]) -> int:
        """Read ``items`` into ``slot`` (blocking). Returns the bytes read."""
        total = 0
        for file, group in _by_file(items):
            total += self._read_file(file, group, slot)
        return total

    def close(self) -> None:
        """Join the decoding threads."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _decoder(self, file: FileInfo, top: str) -> ChunkDecoder:
        key = (id(file), top)
        dec = self._decoders.get(key)
        if dec is None:
            layout = file.layouts[top]
            info = self.catalog.tops[top]
            assert layout.chunk_rows is not None
            dec = ChunkDecoder(
                layout.filters, info.dtype.itemsize, layout.chunk_rows * info.row_bytes
            )
            self._decoders[key] = dec
        return dec

    def _read_file(self, file: FileInfo, items: list[ReadItem], slot: dict[str, np.ndarray]) -> int:
        fd = _open_checked(file)
        h5: h5py.File | None = None
        total = 0
        try:
            for it in items:
                dest = slot[it.top][it.out_start : it.out_start + it.row_stop - it.row_start]
                layout = file.layouts[it.top]
                try:
                    if layout.offset is not None:
                        total += _pread_into(
                            fd, dest, layout.offset + it.row_start * _row_bytes(dest)
                        )
                    elif layout.chunks is not None:
                        total += self._read_chunks(fd, it, layout, dest)
                    else:
                        if h5 is None:
                            h5 = h5py.File(file.path, "r")
                        dset: Any = h5[it.top]
                        dset.read_direct(dest, np.s_[it.row_start : it.row_stop])
                        total += dest.nbytes
                except ReadError as exc:
                    raise ReadError(f"{it.describe()}: {exc}") from exc
                except (OSError, ValueError, KeyError, TypeError, zlib.error) as exc:
                    # TypeError: h5py's "Can't broadcast" when the dataset no longer has the rows.
                    raise ReadError(f"{it.describe()}: read failed: {exc}") from exc
        finally:
            os.close(fd)
            if h5 is not None:
                h5.close()
        return total

    def _read_chunks(self, fd: int, it: ReadItem, layout: Layout, dest: np.ndarray) -> int:
        """Read and decode the stored chunks covering ``it``, on the pool's threads."""
        index, rows = layout.chunks, layout.chunk_rows
        assert index is not None and rows is not None
        decoder = self._decoder(it.file, it.top)
        flat = dest.reshape(len(dest), -1).view(np.uint8)
        row_bytes = flat.shape[1]

        def one(k: int) -> int:
            size = int(index.sizes[k])
            raw = os.pread(fd, size, int(index.offsets[k]))
            if len(raw) != size:
                raise ReadError(f"stored chunk {k} is cut short (the file is truncated)")
            try:
                data = decoder.decode(raw, int(index.masks[k])).reshape(rows, row_bytes)
            except Exception as exc:
                # Each codec has its own error class (deflate.DeflateError, isal's IsalError,
                # numcodecs' RuntimeError, ...): a chunk that does not decode is a failed read.
                raise ReadError(
                    f"stored chunk {k} ({size} bytes at offset {int(index.offsets[k])}) does "
                    f"not decode: {type(exc).__name__}: {exc}"
                ) from exc
            a, b = max(it.row_start, k * rows), min(it.row_stop, (k + 1) * rows)
            flat[a - it.row_start : b - it.row_start] = data[a - k * rows : b - k * rows]
            return size

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, "asynchdf5-decode")
        ks = range(it.row_start // rows, (it.row_stop - 1) // rows + 1)
        futures = [self._pool.submit(one, k) for k in ks]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err
        return sum(f.result() for f in futures)


def _by_file(items: Sequence[ReadItem]) -> Iterator[tuple[FileInfo, list[ReadItem]]]:
    groups: dict[int, tuple[FileInfo, list[ReadItem]]] = {}
    for it in items:
        groups.setdefault(id(it.file), (it.file, []))[1].append(it)
    return iter(groups.values())


def _open_checked(file: FileInfo) -> int:
    try:
        fd = os.open(file.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise ReadError(f"{file.path}: the file was deleted after the source was opened") from exc
    except OSError as exc:
        raise ReadError(f"{file.path}: cannot open the file: {exc}") from exc
    st = os.fstat(fd)
    dev, ino, size, mtime = file.identity
    # The mtime catches a file rewritten in place, or replaced by one of the same size that got
    # the old inode number back (common right after a delete): its rows are not the catalogued
    # ones, and on the pread path nothing else would notice.
    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (dev, ino, size, mtime):
        os.close(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):
            what = "replaced"
        elif st.st_size != size:
            what = "truncated or resized"
        else:
            what = "modified"
        raise ReadError(
            f"{file.path}: the file was {what} after the source was opened "
            f"(size {size} -> {st.st_size} bytes)"
        )
    return fd


def _row_bytes(a: np.ndarray) -> int:
    return int(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)))


def _pread_into(fd: int, dest: np.ndarray, offset: int) -> int:
    """Fill ``dest`` (C-contiguous) from ``fd`` at ``offset`` with as few syscalls as possible."""
    view = memoryview(dest.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    done = 0
    n = len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ReadError(
                f"unexpected end of file at byte {offset + done} (the file is truncated)"
            )
        done += got
    return n


class HDF5Source:
    """The pipeline's data source for HDF5 files: reads chunks into cache slots.

    *Streaming* (``slots`` given): each chunk is read into a free slot, every epoch. *Resident*
    (``resident`` arrays of every sample given instead): when the whole data set is one chunk and
    fits the cache budget, each sample is read once, at its global index, the first time a chunk
    needs it, and later epochs are served from memory without reading again.
    """

    def __init__(
        self,
        catalog: Catalog,
        slots: list[Slot] | None,
        resident: dict[str, np.ndarray] | None = None,
        read_threads: int = 2,
    ) -> None:
        self.catalog = catalog
        self.reader = HDF5Reader(catalog)
        self.tops = catalog.tops
        self.n_samples = catalog.n_samples
        self.slots: list[Slot] | None = slots
        self.resident = resident
        self._loaded: list[tuple[int, int]] = []  # sorted, disjoint: what `resident` holds
        # Pieces of a chunk (several tops, several files) are read by up to `read_threads`
        # threads at once: more requests in flight for the disk, more memcpy for a warm cache.
        self._limiter = anyio.CapacityLimiter(read_threads)

    async def load(self, chunk: ChunkPlan, slot: Slot | None, stats: Stats) -> LoadedChunk:
        t0 = time.perf_counter()
        if self.resident is not None:
            arrays = self.resident
            items = self.reader.items_for(
                [(a, b, a) for r0, r1 in chunk.ranges for a, b in _missing(self._loaded, r0, r1)]
            )
        else:
            assert slot is not None
            arrays = slot.arrays
            items = self.reader.items(chunk)
        order: list[np.ndarray | None] = [None]

        async def read(item: ReadItem) -> None:
            n = await anyio.to_thread.run_sync(
                self.reader.read, (item,), arrays, limiter=self._limiter
            )
            stats.bytes_read += n  # not `+= await`: that reads the counter before awaiting

        async def permute() -> None:
            order[0] = await anyio.to_thread.run_sync(chunk.order, limiter=self._limiter)

        # One worker-thread call per piece keeps each call short, so cancelling a run never waits
        # for more than a piece per thread.
        async with anyio.create_task_group() as tg:
            tg.start_soon(permute)
            for item in items:
                tg.start_soon(read, item)
        if self.resident is not None:
            for a, b in chunk.ranges:
                _add(self._loaded, a, b)
        if items:
            stats.read_seconds += time.perf_counter() - t0
            stats.chunks_read += 1
        return LoadedChunk(chunk, order[0], arrays, rows_are_global=self.resident is not None)

    def close(self) -> None:
        self.reader.close()
        self.slots = None
        self.resident = None


def _missing(loaded: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """The parts of ``a:b`` not covered by the sorted, disjoint intervals ``loaded``."""
    out = []
    pos = a
    for s, e in loaded:
        if e <= pos:
            continue
        if s >= b:
            break
        if s > pos:
            out.append((pos, s))
        pos = e
        if pos >= b:
            break
    if pos < b:
        out.append((pos, b))
    return out


def _add(loaded: list[tuple[int, int]], a: int, b: int) -> None:
    """Add ``a:b`` to the sorted, disjoint intervals ``loaded``, merging neighbours."""
    loaded.append((a, b))
    loaded.sort()
    merged = [loaded[0]]
    for s, e in loaded[1:]:
        if s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    loaded[:] = merged
