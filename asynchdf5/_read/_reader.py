"""Chunk reader: fills a cache slot with the rows of a chunk, for all tops.

The catalog says how each top of each file is stored; from that, the reader turns a chunk into
byte ranges and hands them to the source (the seam: local files, remote objects), which moves the
bytes and checks that the files did not change:

* ``pread``: contiguous data is fetched straight into the slot (and byte-swapped in place when
  stored in the other byte order), outside h5py's process-wide lock.
* ``chunks`` (:mod:`._chunked`): unfiltered chunks of whole samples are fetched straight into the
  slot, neighbouring chunks adjacent in the file as one request; other chunks are fetched in runs
  of adjacent ones and decoded by a pool of threads (:mod:`.._codecs`, checksums verified), each
  once per read, outside h5py's lock; partial edge chunks stored unfiltered are copied as is.
* ``h5py``: everything else is read with ``Dataset.read_direct``. **This holds h5py's lock** for
  the call, so reads are cut into pieces of at most the source's ``piece_bytes``. The files it
  used are checked afterwards, by name too for those HDF5 opens by name (external raw files, virtual
  sources): a source that vanished would have come out as fill values.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread
import numpy as np

from .._catalog import Catalog, Segment, TopInfo
from .._codecs import ChunkDecoder
from .._errors import ReadError
from .._layout import Layout
from .._pages import free_arrays
from .._plan import ChunkPlan
from .._priority import background
from .._ragged_tops import heap_keys
from .._sources import ByteRange, Source, Streaming
from .._stats import ReadStats
from .._thread_call import release_whole
from ._chunked import Need, chunk_reads
from ._spans import merged, uncovered
from ._steps import H5pyRead, VlenRead, byte_view, direct_ranges, swapper, window_reads

if TYPE_CHECKING:  # annotations only: _specs is a stage above the readers
    from .._specs import Rows

__all__ = ["HDF5Reader", "Reader", "fill_threads"]


def fill_threads() -> int:
    """Threads that read a resident data set into its memory at once: as many as cores, from 2
    to 8. Those reads write memory never written before, so faulting its pages in and copying
    into them cost CPU (a page cache copy into fresh memory runs far below one into memory
    already written): more threads spread that cost over the cores where there are any."""
    return max(2, min(8, os.cpu_count() or 1))


class Reader(Protocol):
    """What the pipeline reads chunks from (an HDF5 source through the cache, or arrays)."""

    @property
    def tops(self) -> Mapping[str, TopInfo]: ...

    @property
    def n_samples(self) -> int: ...

    @property
    def in_place(self) -> bool:
        """Rows are served from the reader's own arrays, at their global indices (no cache
        slots are needed)."""
        ...

    @property
    def own_arrays(self) -> Mapping[str, Rows] | None:
        """Those arrays when :attr:`in_place` (filled as chunks are read), else ``None``; a
        mapped source's rows in chunks or over several files are no array (:class:`Rows`)."""
        ...

    @property
    def reads_at_once(self) -> int:
        """In place: how many chunks' reads may run at once (a chunk waits for rows another
        read is filling); the loader hands them on in plan order either way."""
        ...

    @property
    def read_paths(self) -> Mapping[str, str]:
        """How each top is read (see :class:`~asynchdf5.LayerStats`)."""
        ...

    @property
    def read_notes(self) -> Mapping[str, str]: ...

    async def read(
        self, chunk: ChunkPlan, into: Mapping[str, np.ndarray] | None, stats: ReadStats
    ) -> tuple[Mapping[str, Rows], bool]:
        """Put the chunk's rows in memory: into ``into`` (a cache slot's arrays, rows in the
        chunk's range order), or in place. Returns the arrays holding them and whether rows are
        at their global indices there."""
        ...

    def release(self, chunk: ChunkPlan) -> None:
        """The pipeline is done with the rows of ``chunk`` that it took in place."""
        ...

    @property
    def verify(self) -> Callable[[], None] | None:
        """For rows served in place from memory that a file can change under (mapped): raises
        :class:`~asynchdf5.ReadError` if a file changed since it was opened; the pipeline calls
        it after gathering rows and before handing them on. None: nothing can change them."""
        ...

    @property
    def guard(self) -> AbstractContextManager[None] | None:
        """For rows served in place from a mapped file: held around every gather from it
        (raises :class:`~asynchdf5.ReadError` instead once the rows can no longer be read
        safely). None: no gather needs one."""
        ...

    async def aclose(self) -> None:
        """Release threads and files (shielded from cancellation)."""
        ...


class HDF5Reader:
    """Reads chunks of a catalogued source (the pipeline's :class:`Reader` of HDF5 files).

    *Streaming* (no ``resident`` arrays): each chunk is read into the cache slot the pipeline
    gives, every epoch. *Resident* (``resident`` arrays of every sample given): when the whole
    data set is one chunk and fits the cache budget, each sample is read once, at its global
    index, the first time a chunk needs it, and later epochs are served from memory.
    """

    def __init__(
        self,
        catalog: Catalog,
        source: Source,
        resident: dict[str, np.ndarray] | None = None,
        read_threads: int = 2,
        decode_threads: int | None = None,
        streaming: Streaming | None = None,
    ) -> None:
        self.catalog = catalog
        self.source = source
        self.tops: Mapping[str, TopInfo] = catalog.tops
        self.n_samples = catalog.n_samples
        self.read_paths = catalog.read_paths()
        self.read_notes = catalog.read_notes()
        self.resident = resident
        #: Data larger than memory, read from the disk every epoch (see ``Source.fetch``).
        self.streaming = streaming
        self._loaded: list[tuple[int, int]] = []  # sorted, disjoint: what `resident` holds
        # Rows a read is filling now, each with its read's end (set when it ends, filled or not).
        self._filling: list[tuple[int, int, anyio.Event]] = []
        # Pieces of a chunk (several tops, several files) move on up to `read_threads` threads at
        # once: more requests in flight for the disk, more memcpy for a warm cache.
        self._limiter = anyio.CapacityLimiter(read_threads)
        self._decode_threads = decode_threads or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._decoders: dict[int, ChunkDecoder] = {}

    # --- what a chunk needs ---------------------------------------------------------------

    def plan_reads(
        self, placed: Sequence[tuple[int, int, int]], arrays: Mapping[str, np.ndarray]
    ) -> tuple[list[ByteRange], list[H5pyRead], list[Callable[[], None]], list[Callable[[], None]]]:
        """The reads that put global rows ``start:stop`` at row ``out`` of ``arrays``, for each
        ``(start, stop, out)``: byte ranges for the source, h5py reads, steps to run after
        the byte ranges are in (byte swaps), and steps to run in worker threads once every read
        is done (cutting a :class:`~asynchdf5.Windows` top's windows out of the elements read:
        the windows of a segment are one contiguous range of the stream)."""
        piece = self.source.piece_bytes
        segments: list[Segment] = []
        for a, b, out in placed:
            segments.extend(self.catalog.segments(a, b, out))
        ranges: list[ByteRange] = []
        h5reads: list[H5pyRead] = []
        after: list[Callable[[], None]] = []
        cuts: list[Callable[[], None]] = []
        for top, info in self.tops.items():
            if info.ragged is not None:
                self._plan_ragged(top, info, segments, arrays, ranges, h5reads, after)
                continue
            # The rows each chunked layout must give, planned together so that a stored chunk
            # several segments need is read and decoded once.
            chunked: dict[int, tuple[Layout, list[Need]]] = {}
            # The bytes of the whole destination, sliced per segment (a chunk of blocks drawn
            # from all over the file has hundreds of segments: this runs on the event loop).
            whole: memoryview | None = None
            rb = info.row_bytes
            for seg in segments:
                layout = seg.file.layouts.get(top)
                if layout is None:  # another stream's variant of the top (:mod:`.._schemas`)
                    continue
                n = seg.row_stop - seg.row_start
                dest = arrays[top][seg.out_start : seg.out_start + n]
                about = f"top {top!r}, rows {seg.row_start}:{seg.row_stop}"
                r0, r1, erb = seg.row_start, seg.row_stop, rb  # the stored rows to read
                if info.windows is not None:  # the stream's elements under the windows
                    r0, r1, dest, cut = window_reads(dest, r0, r1, *info.windows)
                    about = f"top {top!r}, windows {seg.row_start}:{seg.row_stop}"
                    erb = info.dtype.itemsize
                    cuts.append(cut)
                if layout.path == "pread":
                    if info.windows is not None:
                        view = byte_view(dest)
                    else:
                        if whole is None:
                            whole = byte_view(arrays[top])
                        view = whole[seg.out_start * rb : (seg.out_start + n) * rb]
                    ranges += direct_ranges(layout, r0, r1, view, erb, about, piece)
                    if layout.swap:
                        after.append(swapper(dest))
                elif layout.path == "chunks":
                    chunked.setdefault(id(layout), (layout, []))[1].append(Need(r0, r1, dest))
                    if layout.swap:
                        after.append(swapper(dest))
                else:
                    step = max(1, piece // max(1, erb))
                    for r in range(r0, r1, step):
                        re = min(r1, r + step)
                        part = dest[r - r0 : re - r0]
                        h5reads.append(H5pyRead(layout, r, re, part, f"top {top!r}, rows {r}:{re}"))
            for layout, needs in chunked.values():
                decoder = self._decoder(layout, info.dtype.itemsize)
                ranges += chunk_reads(
                    layout, needs, decoder, f"top {top!r}", piece, fresh=self.resident is not None
                )
        return ranges, h5reads, after, cuts

    def _plan_ragged(
        self,
        top: str,
        info: TopInfo,
        segments: Sequence[Segment],
        arrays: Mapping[str, np.ndarray],
        ranges: list[ByteRange],
        h5reads: list[H5pyRead],
        after: list[Callable[[], None]],
    ) -> None:
        """The reads of a ragged top (:mod:`.._ragged_tops`): each segment's rows are one
        contiguous range of values (``indptr`` says which, from memory), read as a dataset's
        rows are into the next place of the slot's heap, or, resident, at the values' place
        among all files'. Their spans are written here, from ``indptr``."""
        assert info.ragged is not None
        piece = self.source.piece_bytes
        spans = arrays[top]
        heaps = [arrays[k] for k in heap_keys(top, info.ragged.sparse)]
        chunked: dict[int, tuple[Layout, int, list[Need]]] = {}
        # The member each chunked layout holds: its chunks' rows are values of it, not samples.
        members: dict[int, str] = {}
        at = 0
        for seg in segments:
            parts = seg.file.ragged.get(top)
            if parts is None:  # another stream's variant of the top
                continue
            ip, r0, r1 = parts.indptr, seg.row_start, seg.row_stop
            e0, e1 = int(ip[r0]), int(ip[r1])
            if self.resident is not None:
                at = self.catalog.values_base(seg.file, top) + e0
            if at + (e1 - e0) > len(heaps[0]):  # never, by the heap's bound: never overflowed
                raise ReadError(
                    f"{seg.file.name}: top {top!r}, rows {r0}:{r1}: {e1 - e0} values do not fit "
                    f"the cache slot's {len(heaps[0]) - at} left"
                )
            span = spans[seg.out_start : seg.out_start + (r1 - r0)]
            # In int64: an int32 indptr's values are its file's, ``at`` counts all files'.
            np.add(ip[r0:r1], at - e0, out=span[:, 0], dtype=np.int64)
            np.add(ip[r0 + 1 : r1 + 1], at - e0, out=span[:, 1], dtype=np.int64)
            if e1 > e0:
                about = f"top {top!r}, rows {r0}:{r1} (values {e0}:{e1})"
                if parts.vlen is not None:
                    h5reads.append(VlenRead(parts.vlen, r0, r1, heaps[0][at : at + e1 - e0], about))
                pairs = zip((parts.data, parts.indices), heaps, ("data", "indices"), strict=False)
                for layout, heap, member in pairs:
                    if layout is not None:
                        members[id(layout)] = member
                        dest = heap[at : at + e1 - e0]
                        self._plan_rows(layout, e0, e1, dest, about, chunked, ranges, h5reads)
                        if layout.swap:
                            after.append(swapper(dest))
            at += e1 - e0
        for key, (layout, itemsize, needs) in chunked.items():
            decoder = self._decoder(layout, itemsize)
            about = f"top {top!r}, its {members.get(key, 'data')!r}"
            ranges += chunk_reads(
                layout, needs, decoder, about, piece, fresh=self.resident is not None
            )

    def _plan_rows(
        self,
        layout: Layout,
        r0: int,
        r1: int,
        dest: np.ndarray,
        about: str,
        chunked: dict[int, tuple[Layout, int, list[Need]]],
        ranges: list[ByteRange],
        h5reads: list[H5pyRead],
    ) -> None:
        """The reads that put rows ``r0:r1`` of ``layout``'s dataset into ``dest`` (a ragged
        top's values: its ``data`` or ``indices``), by the dataset's read path."""
        rb = dest.dtype.itemsize * int(np.prod(dest.shape[1:], dtype=np.int64))
        piece = self.source.piece_bytes
        if layout.path == "pread":
            ranges += direct_ranges(layout, r0, r1, byte_view(dest), rb, about, piece)
        elif layout.path == "chunks":
            chunked.setdefault(id(layout), (layout, dest.dtype.itemsize, []))[2].append(
                Need(r0, r1, dest)
            )
        else:
            step = max(1, piece // max(1, rb))
            for r in range(r0, r1, step):
                e = min(r1, r + step)
                h5reads.append(H5pyRead(layout, r, e, dest[r - r0 : e - r0], about))

    def _decoder(self, layout: Layout, itemsize: int) -> ChunkDecoder:
        dec = self._decoders.get(id(layout))
        if dec is None:
            assert layout.chunks is not None
            shape = layout.chunks.shape
            chunk_bytes = itemsize * int(np.prod(shape, dtype=np.int64))
            dec = self._decoders[id(layout)] = ChunkDecoder(
                layout.filters, itemsize, chunk_bytes, shape
            )
        return dec

    # --- reading ------------------------------------------------------------------------------

    async def fill(
        self,
        placed: Sequence[tuple[int, int, int]],
        arrays: Mapping[str, np.ndarray],
        stats: ReadStats,
    ) -> int:
        """Read global rows into ``arrays`` (see :meth:`plan_reads`); returns the bytes read."""
        ranges, h5reads, after, cuts = self.plan_reads(placed, arrays)
        if self.resident is not None:  # rows read once, into memory never written before
            for r in ranges:
                r.fresh = r.into is not None
        if self._pool is None and ranges:
            self._pool = ThreadPoolExecutor(
                self._decode_threads, "asynchdf5-decode", initializer=background
            )
        total = [0]

        async def fetch() -> None:
            assert self._pool is not None
            n = await self.source.fetch(
                ranges, self._pool, self._limiter, stats, streaming=self.streaming
            )
            total[0] += n  # not `+= await`: that reads the total before the await
            for step in after:
                step()  # in place on bytes just read: microseconds per megabyte

        async def h5read(read: H5pyRead) -> None:
            n = await anyio.to_thread.run_sync(read, limiter=self._limiter)
            total[0] += n

        # One worker-thread call per piece keeps each call short, so cancelling a run never waits
        # for more than a piece per thread.
        async with anyio.create_task_group() as tg:
            if ranges:
                tg.start_soon(fetch)
            for read in h5reads:
                tg.start_soon(h5read, read)
        if cuts:
            async with anyio.create_task_group() as tg:
                for cut in cuts:
                    tg.start_soon(partial(anyio.to_thread.run_sync, cut, limiter=self._limiter))
        return total[0]

    async def read(
        self, chunk: ChunkPlan, into: Mapping[str, np.ndarray] | None, stats: ReadStats
    ) -> tuple[Mapping[str, np.ndarray], bool]:
        if self.resident is not None:
            return await self._read_resident(chunk, self.resident, stats)
        assert into is not None
        t0 = time.perf_counter()
        placed = []
        out = 0
        for a, b in chunk.ranges:
            placed.append((a, b, out))
            out += b - a
        if placed:
            n = await self.fill(placed, into, stats)  # reads of chunks overlap: add after
            stats.bytes += n
            stats.seconds += time.perf_counter() - t0
            stats.chunks += 1
        return into, False

    async def _read_resident(
        self, chunk: ChunkPlan, arrays: dict[str, np.ndarray], stats: ReadStats
    ) -> tuple[Mapping[str, np.ndarray], bool]:
        """The chunk's rows read once into the resident arrays, at their global indices. Reads
        of two chunks may run at once (:attr:`reads_at_once`): each fills the rows no read holds
        or is filling, and waits for those another read is filling (each row written once)."""
        t0 = time.perf_counter()
        # Whole stored chunks: each is decoded once, not once for every chunk of the plan that
        # needs some of its rows (an epoch's blocks cut across them).
        wanted = [(a, b) for r0, r1 in chunk.ranges for a, b in uncovered(self._loaded, r0, r1)]
        spans = merged([self._whole_chunks(a, b) for a, b in wanted])
        taken = merged([*self._loaded, *((a, b) for a, b, _ in self._filling)])
        placed = [(a, b, a) for s, e in spans for a, b in uncovered(taken, s, e)]
        others = {
            id(ev): ev
            for a, b, ev in self._filling
            if any(a < y and x < b for x, y in wanted)  # rows of this chunk, filled by another
        }
        done = anyio.Event()
        mine = [(a, b, done) for a, b, _ in placed]
        self._filling += mine
        try:
            if placed:
                n = await self.fill(placed, arrays, stats)  # reads of chunks overlap: add after
                stats.bytes += n
                stats.seconds += time.perf_counter() - t0
                stats.chunks += 1
                self._loaded = merged([*self._loaded, *((a, b) for a, b, _ in placed)])
        finally:
            self._filling = [f for f in self._filling if f[2] is not done]
            done.set()
        for ev in others.values():
            await ev.wait()
        missing = [(a, b) for r0, r1 in chunk.ranges for a, b in uncovered(self._loaded, r0, r1)]
        if missing:  # the read filling them failed (its chunk, earlier, reports why)
            a, b = missing[0]
            raise ReadError(f"rows {a}:{b} were not read: the read of an earlier chunk failed")
        return arrays, True

    def _whole_chunks(self, a: int, b: int) -> tuple[int, int]:
        """Global rows ``a:b`` widened to whole stored chunks of every top stored in chunks (a
        row of a chunk's rows of a file, its whole band where chunks split the samples)."""
        lo, hi = a, b
        for seg in self.catalog.segments(a, b):
            f = seg.file
            for top, layout in f.layouts.items():
                index = layout.chunks
                info = self.tops.get(top)
                if layout.path != "chunks" or index is None or info is None:
                    continue
                if info.windows is not None or info.ragged is not None:
                    continue  # its stored rows are not samples
                rows = index.rows
                lo = min(lo, f.start + seg.row_start // rows * rows)
                hi = max(hi, f.start + min(f.nrows, -(-seg.row_stop // rows) * rows))
        return lo, hi

    def release(self, chunk: ChunkPlan) -> None:
        pass  # resident rows stay for later epochs

    verify = None  # rows in memory of its own
    guard = None

    @property
    def in_place(self) -> bool:
        return self.resident is not None

    @property
    def own_arrays(self) -> Mapping[str, np.ndarray] | None:
        return self.resident

    @property
    def reads_at_once(self) -> int:
        """Two, resident: the next chunk's reads (the next piece of a ramp) are planned and
        started while the decoding threads finish the last runs of the chunk before, instead
        of leaving them idle meanwhile."""
        return 2 if self.resident is not None else 1

    def close(self) -> None:
        """Join the decoding threads and close the files (blocking)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.source.close()
        if self.resident is not None:
            free_arrays(self.resident.values())  # here, in the close's worker thread
        self.resident = None

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread (h5py handles are closed too), shielded."""
        with anyio.CancelScope(shield=True):
            await release_whole(self.close)
