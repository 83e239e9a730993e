"""Rows served straight from the page cache: the mapped reader (``mmap``, :mod:`._choice`).

Streaming from a local file, the copying reader moves every byte twice: out of the page cache
into a cache slot (``preadv``), then out of the slot into a batch (the gather). This reader maps
each top's stored bytes into memory instead, so the gather takes rows from the page cache
itself: one copy a byte, as for data already in RAM.

Each chunk is made ready before any batch is cut from it, on a thread of its own: the kernel is
asked to read the chunk's byte ranges ahead (``POSIX_FADV_WILLNEED``), then to map every page of
them (``MADV_POPULATE_READ``, Linux 5.14+). Populating reports a page that cannot be read (the
file truncated under it, a disk error) as an error, which becomes a
:class:`~asynchdf5.ReadError` naming the file, top and rows, and the file's fingerprint is
checked after it, as after a copying read. A page dropped from memory *after* its chunk was made
ready and read again during the gather meets the file as it is then: a file truncated by then
would be a ``SIGBUS`` that ends the process. So the reader holds a read lease on the file while
it is open (:mod:`._lease`): a truncation waits until no gather is in flight, and the run ends
with a ``ReadError``. What it cannot cover: a disk error on such a page, the other cases
:mod:`._lease` lists, and a truncation where Linux granted no lease (only ``mmap=True`` maps
then, and ``read_notes`` says so): a ``SIGBUS``, where the copying reader would raise a
``ReadError``.

Memory: a chunk's pages stay mapped while its batches are cut and gathered; once the pipeline is
done with the chunk, their mappings are dropped (``MADV_DONTNEED``: the pages stay in the page
cache; only this process's mapping of them goes), except in the 2 MiB blocks of the file that a
chunk in flight still has pages in (the kernel maps a whole folio of the page cache, up to 2 MiB,
for any page of it: :meth:`MappedReader._drop_done`). So the mapped pages stay within the blocks
of the chunks in flight, and are never the process's own memory: the kernel can take them back
at any time.

Applies to local files whose tops are stored contiguously, uncompressed, in this machine's byte
order, up to a bound on their number (:func:`._choice.refusal` says why not otherwise, and the
layer copies). A top stored in chunks of whole rows, unfiltered, every chunk written, is mapped
too: a row's bytes are at its chunk's offset plus its place in the chunk, so a batch is one
``np.take`` from the mapping as rows (:class:`._maps.ChunkRows`; chunks at many offsets that
differ by no whole rows are gathered phase by phase, and mapped by default only where the data
set is streamed: :mod:`._choice`), and a chunk's rows are made ready (and dropped) as the byte
spans of the stored chunks they lie in. With several files, each top's rows are a
:class:`._maps.Spliced` of the files' mappings, and the guard is the leases of all
(:class:`._lease.Leases`). A ragged or sparse top (:mod:`.._ragged_tops`) is mapped from a
source of one file only: its heaps (``data``, and a sparse top's ``indices``) are mapped as a
top's rows are, contiguous or in unfiltered chunks of whole values, every chunk written (a row's
values then copied as byte spans cut where its chunks are not back to back in the file:
:class:`._maps.ChunkHeap`), its spans are made from ``indptr``, and the gather holds the guard
around each copy out of a heap as around a fixed top's.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .._catalog import Catalog, FileInfo, TopInfo
from .._errors import ReadError
from .._layout import Layout
from .._machine import memory_bytes
from .._plan import ChunkPlan
from .._priority import background
from .._ragged_tops import INDICES, heap_keys
from .._sources import Source
from .._sources._local import LocalFile
from .._stats import ReadStats
from .._thread_call import release_whole
from ._lease import Lease, Leases
from ._maps import ChunkHeap, Libc, MappedTop, Spliced, get_libc, supported
from ._spans import gaps, merged, uncovered

if TYPE_CHECKING:  # annotations only: _specs is a stage above the readers
    from .._specs import Rows

__all__ = ["MappedReader", "default_keep_bytes", "supported"]

_PAGE = mmap.PAGESIZE
#: ``madvise`` advice values (Linux's, the same on every architecture it runs on).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


class MappedReader:
    """The pipeline's :class:`~asynchdf5._read.Reader` over memory-mapped local files: rows
    are served in place, at their global indices (see the module docstring)."""

    in_place = True
    reads_at_once = 1

    def __init__(
        self,
        catalog: Catalog,
        source: Source,
        leases: Sequence[Lease | str],
        notes: Mapping[str, str],
        *,
        keep_bytes: int | None = None,
    ) -> None:
        """Serve ``catalog``'s files mapped, each guarded by its entry of ``leases`` (in the
        order of the files with rows; taken over: closed with the reader) or, where none was
        granted, not (the entry says why); ``notes``: each top's read note
        (:meth:`._choice.Choice.note_of`)."""
        libc = get_libc()
        assert libc is not None
        self._libc = libc
        self.source = source
        self.tops: Mapping[str, TopInfo] = catalog.tops
        self.n_samples = catalog.n_samples
        # A ragged top's path names its kind (``ragged-mmap``): what refuses it elsewhere.
        self.read_paths = {
            name: "mmap" if t.ragged is None else f"{t.ragged.kind}-mmap"
            for name, t in catalog.tops.items()
        }
        self.read_notes: Mapping[str, str] = dict(notes)
        infos = [f for f in catalog.files if f.nrows > 0]
        self._tops: list[MappedTop] = []
        #: The files' read leases (taken before they are mapped): nobody truncates a file
        #: under a gather.
        held = [lease for lease in leases if isinstance(lease, Lease)]
        self.guard: Lease | Leases | None = (
            None if not held else held[0] if len(held) == 1 else Leases(held)
        )
        # The files mapped stay pinned while the reader lives: the source never closes the
        # descriptors that the mappings, the checks and the read-ahead advice use.
        self._pinned: list[LocalFile] = []
        self._spans: dict[str, np.ndarray] = {}
        try:
            for info in infos:
                for name, top in catalog.tops.items():
                    stored = info.ragged.get(name)
                    if stored is None:
                        self._tops.append(self._map(libc, top, info, info.layouts[name]))
                        continue
                    # A ragged top (one file: :func:`._choice.refusal`): its heaps mapped, its
                    # rows' spans from `indptr`, in memory.
                    assert top.ragged is not None and len(infos) == 1
                    keys = heap_keys(name, top.ragged.sparse)
                    layouts = (stored.data, stored.indices)[: len(keys)]
                    for key, layout in zip(keys, layouts, strict=True):
                        assert layout is not None
                        dtype = top.ragged.index_dtype if key.endswith(INDICES) else top.dtype
                        assert dtype is not None
                        shape = () if key.endswith(INDICES) else top.sample_shape
                        heap = (key, dtype, shape, stored.indptr)
                        self._tops.append(self._map(libc, top, info, layout, heap))
                    self._spans[name] = _spans_of(stored.indptr)
        except BaseException:
            self._close_maps()
            if self.guard is not None:
                self.guard.close()
            self._unpin()
            raise
        arrays: dict[str, Any] = dict(self._spans)
        for name in catalog.tops:
            if name in self._spans:
                arrays.update((t.key, t.array) for t in self._tops if t.name == name)
                continue
            parts = [t for t in self._tops if t.name == name]
            if len(parts) == 1:  # one file: its rows are the array (global index = row)
                arrays[name] = parts[0].array
            else:
                rows = [t.array for t in parts if not isinstance(t.array, (ChunkHeap, type(None)))]
                arrays[name] = Spliced(rows, [t.start for t in parts])  # fixed rows: no heap
        self.own_arrays: Mapping[str, Rows] | None = arrays
        self._files = list({id(t.file): t.file for t in self._tops}.values())
        #: Keep pages mapped from one epoch to the next: the data set fits in memory (see
        #: :func:`default_keep_bytes`), so its pages can stay in the page cache.
        bound = default_keep_bytes() if keep_bytes is None else keep_bytes
        self.keep = sum(t.length for t in self._tops) <= bound
        #: Kept: the rows mapped so far (sorted, disjoint). Else: the row ranges of chunks made
        #: ready and not given back (how many of each), and whether one was given back since
        #: the last drop (the next read drops the mappings, on the reader's thread).
        self._mapped: list[tuple[int, int]] = []
        self._live: collections.Counter[tuple[int, int]] = collections.Counter()
        #: Each live row range's blocks of pages (:meth:`_blocks`), kept while it is live: a
        #: range stays live over several drops, and finding its pages costs more than the drop.
        self._blocks_of: dict[tuple[int, int], list[np.ndarray]] = {}
        self._given_back = False
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, "asynchdf5-map", initializer=background
        )

    def _map(
        self,
        libc: Libc,
        top: TopInfo,
        info: FileInfo,
        layout: Layout,
        heap: tuple[str, np.dtype[Any], tuple[int, ...], np.ndarray] | None = None,
    ) -> MappedTop:
        """Map top ``top`` of file ``info`` stored as ``layout`` (or its heap ``heap``, as
        :class:`._maps.MappedTop` takes it, stored so): its one extent, or its stored chunks of
        whole rows (values), from the first to the end of the last (:func:`._choice.refusal`
        checked them; a heap that ``indptr`` gives no values, or rows of no bytes, are not mapped
        at all)."""
        index = layout.chunks
        nothing = heap is not None and int(heap[3][-1]) == 0  # a heap of no values
        if nothing or (index is None and not layout.extents):  # or rows of no bytes: not mapped
            file, offset, chunks = info.file, 0, None
        elif index is None:
            (ext,) = layout.extents
            file, offset, chunks = ext.file, ext.offset, None
        else:
            at = index.offsets[:, 0]
            file, offset, chunks = index.file, int(at.min()), (index.rows, at)
        assert isinstance(file, LocalFile)
        self._pin(file)
        return MappedTop(libc, top, file, offset, info.nrows, info.start, heap, chunks)

    async def read(
        self, chunk: ChunkPlan, into: Mapping[str, np.ndarray] | None, stats: ReadStats
    ) -> tuple[Mapping[str, Rows], bool]:
        assert self.own_arrays is not None
        t0 = time.perf_counter()
        pool = self._pool
        if pool is None:
            raise ReadError(f"{self._files[0].name}: cannot read: the layer is closed")
        ranges = list(chunk.ranges)
        if not self.keep:
            with self._lock:
                self._live.update(ranges)
        try:
            # As the local source does: submitted from anyio's thread, which waits for it even
            # when cancelled, so the reader's thread never works for a run that is over.
            mapped = await anyio.to_thread.run_sync(
                lambda: pool.submit(self._prepare, ranges).result()
            )
        except BaseException:  # failed or cancelled: nobody will give the chunk back
            self.release(chunk)
            raise
        stats.bytes += mapped  # mapped now: kept pages are not read again
        stats.seconds += time.perf_counter() - t0
        stats.chunks += 1
        return self.own_arrays, True

    def verify(self) -> None:
        """ReadError if a file changed since it was opened: rows gathered from it before this
        call may be of the changed file (the pipeline calls it after each gather)."""
        for f in self._files:
            f.check()

    def release(self, chunk: ChunkPlan) -> None:
        """The pipeline is done with ``chunk``: unless kept, its pages are unmapped (by the
        next read)."""
        if self.keep:
            return
        with self._lock:
            for r in chunk.ranges:
                left = self._live.get(r, 0) - 1
                if left < 0:  # a bug: not an assert, which `python -O` would drop
                    raise AssertionError(f"rows {r} given back more often than made ready")
                if left:
                    self._live[r] = left
                else:
                    del self._live[r]
                self._given_back = True

    def _prepare(self, ranges: list[tuple[int, int]]) -> int:
        """Drop the mappings of the chunks given back, then make ``ranges`` ready (blocking).
        Returns how many bytes were mapped (of the rows not kept mapped already)."""
        self._drop_done()
        if self.keep:  # only what was never mapped: the rest still is
            todo = [m for a, b in ranges for m in uncovered(self._mapped, a, b)]
        else:
            todo = ranges
        self._populate(todo)
        if self.keep:
            self._mapped = merged(self._mapped + todo)
        # Every chunk: a file changed since it was opened is an error before any of its batches.
        if ranges:
            self._check_files(ranges)
            if self.guard is not None and self.guard.broken:
                err = self.guard.error()
                tops = ", ".join(dict.fromkeys(repr(t.name) for t in self._tops))
                raise ReadError(f"top {tops}, {_rows_words(ranges)}: {err}") from err
        return sum(t.nbytes(*rows) for a, b in todo for t in self._tops if (rows := t.local(a, b)))

    def _populate(self, ranges: list[tuple[int, int]]) -> None:
        """Read the rows ahead and map their pages (blocking); ReadError if a page cannot be.

        Per top, the pages of all ``ranges`` at once, with gaps of less than :data:`BRIDGE`
        between them populated too (:func:`._spans.merged`): one call for many small rows (a label's
        8 bytes) close together, rather than one a row range."""
        work = []
        for t in self._tops:
            own = [(a, b, rows) for a, b in ranges if (rows := t.local(a, b))]
            pages = [p for _, _, rows in own for p in t.pages(*rows)]
            work.append((t, own, merged(pages, BRIDGE)))  # no pages: ragged rows holding no values
        for t, _, spans in work:  # every read queued first: the disk sees them all at once
            base = t.offset - t.skip  # the file offset of the mapping's first byte
            for lo, hi in spans:
                with contextlib.suppress(OSError):  # advice only
                    os.posix_fadvise(t.file.fd, base + lo, hi - lo, os.POSIX_FADV_WILLNEED)
        for t, own, spans in work:
            for lo, hi in spans:
                err = self._libc.madvise(t.address + lo, hi - lo, _POPULATE_READ)
                if not err:
                    continue
                # The row ranges with pages in the span that failed, as global rows.
                failed = [
                    (t.start + r[0], t.start + r[1])
                    for _, _, r in own
                    if any(x < hi and lo < y for x, y in t.pages(*r))
                ]
                self._check_files(failed)  # a file that changed is the cause to report
                raise ReadError(
                    f"{t.file.name}: top {t.name!r}, {_rows_words(failed)}: read failed: "
                    f"{os.strerror(err)}"
                )

    def _check_files(self, ranges: list[tuple[int, int]]) -> None:
        """ReadError if a file changed since it was opened, naming its own rows among
        ``ranges`` (global rows being read), or, when none of them is in that file, the rows
        being read as rows of other files: never another file's rows as if they were its."""
        for f in self._files:
            try:
                f.check()
            except ReadError as exc:
                tops = [t for t in self._tops if t.file is f]
                names = ", ".join(dict.fromkeys(repr(t.name) for t in tops))
                first, own = tops[0], []  # every top of a file has the same rows
                for a, b in ranges:
                    rows = first.local(a, b)
                    if rows is not None:
                        own.append((first.start + rows[0], first.start + rows[1]))
                if own:
                    raise ReadError(f"top {names}, {_rows_words(own)}: {exc}") from exc
                raise ReadError(
                    f"top {names}, while reading {_rows_words(ranges)} of other files: {exc}"
                ) from exc

    def _drop_done(self) -> None:
        """Once a chunk was given back: unmap every page but those of the blocks of
        :data:`._maps.FOLIO_BYTES` that the live chunks' pages lie in.

        Every page, not only the chunk's: mapping a page maps the cached pages around it too
        (the kernel's fault-around, 64 KiB, or the whole folio of the page cache that holds it,
        up to 2 MiB), which may belong to chunks given back before. Not the rest of a live
        chunk's blocks: the kernel maps them again with the chunk's next page (a shuffled
        chunk's rows lie in nearly every block of the file), so unmapping them would only be
        done again with every chunk, for no memory given back. A page that a later chunk needs
        is mapped again when that chunk is made ready."""
        with self._lock:
            given_back, self._given_back = self._given_back, False
            live = list(self._live)
        if not given_back:
            return
        known, self._blocks_of = self._blocks_of, {}
        for r in live:
            self._blocks_of[r] = known.get(r) or self._blocks(*r)
        per_range = self._blocks_of.values()
        for i, t in enumerate(self._tops):
            spans = [b[i] for b in per_range]
            used = np.concatenate(spans) if spans else np.empty((0, 2), np.int64)
            for x, y in gaps(used[:, 0], used[:, 1], 0, t.end):
                self._libc.madvise(t.address + x, y - x, _DONTNEED)

    def _blocks(self, a: int, b: int) -> list[np.ndarray]:
        """Per top (in :attr:`_tops`' order), the blocks of pages that global rows ``a:b`` lie
        in (:meth:`._maps.MappedTop.folios`), as an array of ``(start, stop)`` rows."""
        out = []
        for t in self._tops:
            rows = t.local(a, b)
            blocks = [t.folios(lo, hi) for lo, hi in t.pages(*rows)] if rows else []
            out.append(np.array(blocks, np.int64).reshape(-1, 2))
        return out

    def _close_maps(self) -> None:
        for t in self._tops:
            t.array = None  # unmapped now, or when the last view elsewhere goes

    def close(self) -> None:
        """Join the reader's thread, unmap the file and close the source (blocking)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.own_arrays = None
        self._close_maps()
        if self.guard is not None:
            self.guard.close()
        self._unpin()
        self.source.close()

    def _pin(self, file: LocalFile) -> None:
        if all(file is not f for f in self._pinned):
            file.pin()
            self._pinned.append(file)

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, []
        for f in pinned:
            f.unpin()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await release_whole(self.close)


def default_keep_bytes() -> int:
    """The largest data set whose pages stay mapped between epochs: half the memory this
    process may use (the machine's, or its container's limit). A larger one cannot stay in the
    page cache anyway; its chunks are unmapped after use."""
    return memory_bytes() // 2


#: Pages of a chunk's rows this close (or closer) are populated with the pages between them, in
#: one call: the fault-around the kernel maps with any page (64 KiB), far less than it reads
#: ahead from the disk, and one call costs more than mapping that many cached pages.
BRIDGE = 64 * 1024


def _rows_words(ranges: list[tuple[int, int]]) -> str:
    """Global rows ``ranges`` in an error message: ``rows a:b`` for one range, else how many
    and the span they lie in."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return f"rows {a}:{b}"
    n = sum(b - a for a, b in ranges)
    return f"{n} rows in {min(a for a, _ in ranges)}:{max(b for _, b in ranges)}"


def _spans_of(indptr: np.ndarray) -> np.ndarray:
    """The spans of a ragged top's rows, ``(rows, 2)``: row ``i``'s is ``indptr[i:i + 2]``, a
    read-only view of ``indptr`` whose rows overlap, in its dtype (no copy: 16 bytes a row
    saved; the gather takes its rows' spans by fancy index, a copy in int64). Of no row or one,
    int64: such a view would be C-contiguous, and the gather takes those as a slot's spans."""
    if len(indptr) <= 2:
        indptr = indptr.astype(np.int64)
    step = indptr.strides[0]
    return np.lib.stride_tricks.as_strided(
        indptr, (len(indptr) - 1, 2), (step, step), writeable=False
    )
