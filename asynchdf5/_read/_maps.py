"""The mappings the mapped reader (:mod:`._mapped`) serves rows from: ``mmap`` and ``madvise``
through the C library, one top of one file mapped (:class:`MappedTop`), the rows of a top stored
in chunks of whole rows indexed by row (:class:`ChunkRows`), the values of a ragged top's heap
stored in chunks (:class:`ChunkHeap`), and the rows of one top over several mapped files indexed
as one (:class:`Spliced`)."""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._blocks import copy_runs
from .._catalog import TopInfo
from .._errors import ReadError
from .._pages import MAP_FAILED, libc_madvise, libc_mmap
from .._sources._local import LocalFile
from ._spans import merged

if TYPE_CHECKING:
    from .._blocks import ScatteredValues
    from .._specs import Rows

__all__ = [
    "FOLIO_BYTES", "ChunkHeap", "ChunkRows", "Libc", "MappedTop", "Spliced", "get_libc",
    "run_starts", "supported",
]  # fmt: skip

_PAGE = mmap.PAGESIZE
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: The largest block of a file's page cache the kernel maps at once for one page asked for:
#: a folio of the page cache (Linux 6.x holds a file's cached pages in folios of up to 2 MiB,
#: a PMD's span on x86-64 and arm64 with 4 KiB pages, aligned in the file to their size), all
#: of whose pages a fault or ``MADV_POPULATE_READ`` maps.
FOLIO_BYTES = 2 * 2**20


class Libc:
    """``mmap``, ``munmap`` and ``madvise`` through ctypes. Unlike ``mmap.mmap.madvise``, the
    calls release the GIL, so populating a chunk (which may wait for the disk) never holds up
    the event loop; and unlike ``mmap.mmap`` (before Python 3.13), a mapping made this way keeps
    no duplicate of the file's descriptor, so a view that outlives the layer in a reference
    cycle holds no descriptor open until the garbage collector frees it."""

    def __init__(self) -> None:
        self._mmap, self._munmap = libc_mmap()
        madvise = libc_madvise()
        if madvise is None:
            raise OSError("the C library has no madvise")
        self._madvise = madvise

    def map(self, fd: int, length: int, offset: int) -> int:
        """The address of ``length`` bytes of ``fd`` from ``offset`` (a page boundary), mapped
        read-only; OSError if they cannot be."""
        address = self._mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if address is None or address == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return int(address)

    def unmap(self, address: int, length: int) -> None:
        self._munmap(address, length)

    def madvise(self, address: int, length: int, advice: int) -> int:
        """0, or the ``errno`` of the failed call."""
        if self._madvise(address, length, advice) == 0:
            return 0
        return ctypes.get_errno()


_libc: Libc | None = None
_libc_lock = threading.Lock()


def get_libc() -> Libc | None:
    """The C library's ``madvise``, where the platform has it and ``MADV_POPULATE_READ`` works
    (None elsewhere)."""
    global _libc
    with _libc_lock:
        if _libc is None and sys.platform.startswith("linux"):
            try:
                libc = Libc()
            except (OSError, AttributeError):
                return None
            # Probe on one anonymous page: kernels before 5.14 answer EINVAL.
            probe = mmap.mmap(-1, _PAGE)
            try:
                address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
                ok = libc.madvise(address, _PAGE, _POPULATE_READ) == 0
            finally:
                probe.close()
            if ok:
                _libc = libc
        return _libc


def supported() -> str | None:
    """Why this platform cannot map a source (None: it can)."""
    if get_libc() is None:
        return "mapping needs Linux 5.14 or newer (MADV_POPULATE_READ)"
    if sys.maxsize < 2**32:  # file offsets are passed to mmap as 64-bit off_t
        return "mapping needs a 64-bit Python"
    return None


def run_starts(at: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Which stored chunks (of ``chunk_bytes`` each, at file offsets ``at``, in row order)
    start a run of chunks back to back in the file, each of the others starting where the one
    before it ends (bool, the first chunk's True)."""
    at = np.asarray(at, np.int64)
    starts = np.ones(len(at), bool)
    np.not_equal(at[1:], at[:-1] + chunk_bytes, out=starts[1:])
    return starts


def _segments(at: np.ndarray, chunk_rows: int, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of stored chunks (of ``chunk_rows`` rows of ``row_bytes``, at offsets ``at``, in
    row order) back to back in the file (:func:`run_starts`): each run's first row, then a
    bound past every row (int64 max), and where row ``r`` of run ``g`` lies:
    ``delta[g] + r * row_bytes``."""
    at = np.asarray(at, np.int64)
    first = np.flatnonzero(run_starts(at, chunk_rows * row_bytes))
    rows = first * chunk_rows
    return np.append(rows, np.iinfo(np.int64).max), at[first] - rows * row_bytes


class MappedTop:
    """One top's stored bytes in one file, mapped: the array of its rows, where it lies in
    memory, and the global index of its row 0 (:attr:`start`).

    A ragged top's heap (its values, or a sparse top's column indices: :attr:`key` names it
    among the reader's arrays) is mapped the same way, given the file's ``indptr``: its array
    holds the values, and the rows it is asked about (:meth:`local`, :meth:`spans`) are still
    the top's rows, each the range of values ``indptr`` says.

    A top stored in chunks of whole rows (``chunks``: rows per chunk and each chunk's file
    offset, every chunk stored unfiltered at exactly its rows' bytes: :func:`._choice.refusal`
    checks) is mapped from its first chunk to the end of its last, whatever lies between (the
    chunk index's nodes, other tops' chunks); its array is a :class:`ChunkRows`, and a run of
    its rows is a byte span per run of stored chunks back to back in the file that it touches
    (the runs found once, when mapped). A heap stored so (``heap`` and ``chunks``: values per
    chunk) is mapped the same way; its array is a :class:`ChunkHeap`, and a run of the top's rows
    is a byte span per run of chunks their values touch.

    The mapping goes when the last view of :attr:`array` does (never under a live view)."""

    __slots__ = (
        "address", "array", "chunk_at", "chunk_rows", "file", "indptr", "key", "length", "name",
        "nrows", "offset", "row_bytes", "seg_delta", "seg_first", "skip", "start",
    )  # fmt: skip

    def __init__(
        self,
        libc: Libc,
        info: TopInfo,
        file: LocalFile,
        offset: int,
        nrows: int,
        start: int,
        heap: tuple[str, np.dtype[Any], tuple[int, ...], np.ndarray] | None = None,
        chunks: tuple[int, np.ndarray] | None = None,
    ) -> None:
        """``heap``: a ragged top's heap, as its key, the values' dtype and trailing shape, and
        the file's ``indptr`` (None: the top's rows themselves). ``chunks``: the top (or heap)
        is stored in chunks of that many whole rows (values), at those file offsets (int64, in
        row order; ``offset`` is then the lowest of them)."""
        self.name, self.file, self.row_bytes = info.name, file, info.row_bytes
        self.offset, self.nrows, self.start = offset, nrows, start
        self.key, dtype, shape = info.name, info.dtype, info.sample_shape
        self.indptr: np.ndarray | None = None
        items = nrows
        self.chunk_rows = 0
        #: Where each stored chunk starts, from the data's start (``offset``): chunked tops only.
        self.chunk_at: np.ndarray | None = None
        if heap is not None:
            self.key, dtype, shape, self.indptr = heap
            self.row_bytes = dtype.itemsize * math.prod(shape)
            items = int(self.indptr[-1])
        # A mapping starts at a page boundary: `skip` bytes of the page before the data.
        self.skip = offset % _PAGE
        self.length = length = self.skip + items * self.row_bytes
        #: Runs of stored chunks back to back in the file (chunked tops only): each one's first
        #: row (value), then a bound past the last, and where its row 0 would lie.
        self.seg_first: list[int] = []
        self.seg_delta: list[int] = []
        if chunks is not None:
            self.chunk_rows, at = chunks
            self.chunk_at = np.asarray(at, np.int64) - offset
            end = int(self.chunk_at.max()) + self.chunk_rows * self.row_bytes if len(at) else 0
            self.length = length = self.skip + end
            first, delta = _segments(self.chunk_at, self.chunk_rows, self.row_bytes)
            self.seg_first, self.seg_delta = first.tolist(), delta.tolist()
        self.array: np.ndarray | ChunkRows | ChunkHeap | None
        if length == 0:  # a heap of no values, or rows of no bytes: nothing to map
            self.address = 0  # (a zero-length mmap fails)
            self.array = np.empty((items, *shape), dtype)
            return
        try:
            self.address = libc.map(file.fd, length, offset - self.skip)
        except OSError as exc:
            raise ReadError(f"{file.name}: top {info.name!r}: cannot map the file: {exc}") from exc
        whole = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(self.address))
        # Every view of `whole` refers to it (it does not own its memory): unmapped once the
        # last view is gone.
        finalizer = weakref.finalize(whole, libc.unmap, self.address, length)
        # Not at interpreter exit: a daemon gather thread may still be reading the mapping then.
        finalizer.atexit = False
        whole.flags.writeable = False  # mapped read-only: a write would be a SIGSEGV
        if self.chunk_at is not None and heap is not None:
            self.array = ChunkHeap(
                whole, self.skip + self.chunk_at, self.chunk_rows, items, dtype, shape
            )
        elif self.chunk_at is not None:
            self.array = ChunkRows(
                whole, self.skip + self.chunk_at, self.chunk_rows, nrows, dtype, shape
            )
        else:
            self.array = whole[self.skip :].view(dtype).reshape(items, *shape)

    def spans(self, a: int, b: int) -> list[tuple[int, int]]:
        """Where the bytes of this file's rows ``a:b`` lie, from the data's start: one span, or
        for a chunked top (or heap: the chunks of the rows' values) one per run of stored chunks
        back to back in the file (sorted, disjoint)."""
        if self.indptr is not None:  # the rows' values, the units of a heap's chunks
            a, b = int(self.indptr[a]), int(self.indptr[b])
        if self.chunk_at is None:
            return [(a * self.row_bytes, b * self.row_bytes)] if a < b else []
        if a >= b:
            return []
        rb, first, delta = self.row_bytes, self.seg_first, self.seg_delta
        g0 = bisect.bisect_right(first, a) - 1
        g1 = bisect.bisect_right(first, b - 1) - 1
        if g0 == g1:  # within one run of chunks back to back
            return [(delta[g0] + a * rb, delta[g0] + b * rb)]
        if g1 - g0 < 64:  # runs back to back in the file: one span
            return merged(
                [
                    (delta[g] + max(a, first[g]) * rb, delta[g] + min(b, first[g + 1]) * rb)
                    for g in range(g0, g1 + 1)
                ]
            )
        f, d = np.asarray(first, np.int64), np.asarray(delta, np.int64)
        g = np.arange(g0, g1 + 1, dtype=np.int64)
        lo = d[g] + np.maximum(a, f[g]) * rb
        hi = d[g] + np.minimum(b, f[g + 1]) * rb
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        starts = np.flatnonzero(np.r_[True, lo[1:] != hi[:-1]])  # runs back to back: one span
        ends = np.r_[starts[1:], len(lo)] - 1
        return list(zip(lo[starts].tolist(), hi[ends].tolist(), strict=True))

    def nbytes(self, a: int, b: int) -> int:
        """The bytes of this file's rows ``a:b``."""
        return sum(hi - lo for lo, hi in self.spans(a, b))

    def pages(self, a: int, b: int) -> list[tuple[int, int]]:
        """Where the pages holding rows ``a:b`` start and end, from :attr:`address` (sorted,
        disjoint)."""
        out = []
        for lo, hi in self.spans(a, b):
            lo, hi = lo + self.skip, hi + self.skip
            out.append((lo - lo % _PAGE, -(-hi // _PAGE) * _PAGE))
        return merged(out)

    def folios(self, lo: int, hi: int) -> tuple[int, int]:
        """Mapping offsets ``lo:hi`` (from :attr:`address`) widened to the blocks of
        :data:`FOLIO_BYTES` of the file they lie in (aligned in the file, not in the mapping),
        within the mapping."""
        base = self.offset - self.skip  # the file offset of the mapping's first byte
        lo = (base + lo) // FOLIO_BYTES * FOLIO_BYTES - base
        hi = -(-(base + hi) // FOLIO_BYTES) * FOLIO_BYTES - base
        return max(0, lo), min(self.end, hi)

    @property
    def end(self) -> int:
        """Where the mapping's last page ends, from :attr:`address`."""
        return -(-self.length // _PAGE) * _PAGE

    def local(self, a: int, b: int) -> tuple[int, int] | None:
        """Global rows ``a:b``, as rows of this file (None: none of them is)."""
        lo, hi = max(a, self.start), min(b, self.start + self.nrows)
        return (lo - self.start, hi - self.start) if lo < hi else None


#: The most bytes of rows :meth:`ChunkRows.take` gathers into a thread's scratch at once (a
#: batch spread over many phases is taken in pieces of rows that fit): a few MiB, so that each
#: phase's ``np.take`` has rows enough to be worth its call, and the pass that puts them in batch
#: order reads them back from the processor's cache.
SCRATCH_BYTES = 4 * 2**20


class ChunkRows:
    """The rows of one top stored in one mapped file in chunks of whole rows, indexed by row:
    what the gather takes rows from (it calls :meth:`take`, as ``np.take`` does on an object
    that has one; :func:`len` bounds the rows it may ask for).

    Row ``r`` is the ``row_bytes`` bytes at ``at[r // chunk_rows] + (r % chunk_rows) *
    row_bytes`` of the mapping. Chunks whose offsets differ by whole rows (one *phase*: offset
    modulo ``row_bytes``) lie in one array of rows over the mapping, the bytes between runs of
    them (the chunk index's nodes, other data) rows never asked for; ``np.take`` gathers only
    from such an array (of any other view it copies the whole source first). A batch whose rows
    are nearly all at the phase most chunks are at is one ``np.take`` from that phase's array,
    the few others fetched again from their own phase's array by a fancy index. A batch spread
    over many phases (the v1 B-tree's nodes between every few dozen chunks, as h5py's default
    libver writes them, leave dozens) is taken phase by phase, each phase's rows by one
    ``np.take`` into consecutive rows of a reused scratch, then put in batch order by one
    ``np.take`` from the scratch (contiguous, in the cache): a fancy index for most rows would
    be slower."""

    def __init__(
        self,
        whole: np.ndarray,
        at: np.ndarray,
        chunk_rows: int,
        nrows: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
    ) -> None:
        """``whole``: the mapping's bytes (uint8, read-only); ``at``: where each stored chunk
        starts in it (int64, in row order); rows of ``dtype`` and ``shape``, ``nrows`` of
        them."""
        self.dtype = np.dtype(dtype)
        self.shape = (nrows, *shape)
        rb = self.dtype.itemsize * math.prod(shape)
        at = np.asarray(at, np.int64)
        assert rb > 0 and len(at) > 0
        self.chunk_rows = chunk_rows
        phases, of, counts = np.unique(at % rb, return_inverse=True, return_counts=True)
        main = int(np.argmax(counts))
        order = [main, *(i for i in range(len(phases)) if i != main)]
        #: Each phase's array of rows over the mapping, the main phase's first, as items of
        #: ``row_bytes`` bytes: a phase need not be aligned for ``dtype``, and ``np.take``
        #: would copy a whole unaligned array first. Each chunk's rows lie within its own
        #: phase's array (the mapping ends where the last chunk does).
        self._item = item = np.dtype(f"V{rb}")
        self.phases = []
        for i in order:
            p = int(phases[i])
            self.phases.append(whole[p : p + (len(whole) - p) // rb * rb].view(item))
        rank = np.empty(len(phases), np.int64)
        rank[order] = np.arange(len(phases))
        #: Each chunk's phase (0: the main one) and its first row in that phase's array.
        self.phase = rank[of.reshape(-1)]
        self.first = (at - phases[of.reshape(-1)]) // rb
        #: Each gathering thread's scratch (:meth:`_by_phase`), reused: never written memory
        #: costs a page fault a page. Freed with this object.
        self._scratch = threading.local()

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """The bytes of its rows (as an array's: what the pipeline sizes its groups by)."""
        return self.shape[0] * self._item.itemsize

    def take(
        self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "clip"
    ) -> np.ndarray:
        """``np.take(rows, indices, axis=0, out=out)`` (every index a row: the pipeline checks
        them)."""
        assert axis == 0
        idx = np.asarray(indices, np.int64).reshape(-1)
        n = len(idx)
        if out is None:
            out = np.empty((n, *self.shape[1:]), self.dtype)
        direct = out.flags.c_contiguous and out.dtype == self.dtype
        dest = np.ndarray((n,), self._item, out, 0) if direct else np.empty(n, self._item)
        k = idx // self.chunk_rows
        where = self.first[k] + (idx - k * self.chunk_rows)
        if len(self.phases) == 1:
            np.take(self.phases[0], where, out=dest, mode="clip")
        else:
            phase = self.phase[k]
            counts = np.bincount(phase, minlength=len(self.phases))
            if n - int(counts[0]) <= n // 8:
                self._main_then_others(dest, where, phase, counts)
            else:
                self._by_phase(dest, where, phase)
        if not direct:
            out[...] = dest.view(self.dtype).reshape(out.shape)
        return out

    def _main_then_others(
        self, dest: np.ndarray, where: np.ndarray, phase: np.ndarray, counts: np.ndarray
    ) -> None:
        """Rows nearly all at the main phase: one ``np.take`` from its array, then the rows
        at others (``counts`` per phase) fetched again from theirs."""
        # Clipped: a row of another phase may lie past the main array's end; it is fetched again.
        np.take(self.phases[0], where, out=dest, mode="clip")
        for i in np.flatnonzero(counts[1:]).tolist():
            sel = np.flatnonzero(phase == i + 1)
            dest[sel] = self.phases[i + 1][where[sel]]

    def _by_phase(self, dest: np.ndarray, where: np.ndarray, phase: np.ndarray) -> None:
        """Rows at many phases: in pieces that fit the scratch, each phase's rows by one
        ``np.take`` into consecutive scratch rows, then one ``np.take`` into batch order."""
        n = len(where)
        step = max(1, SCRATCH_BYTES // self._item.itemsize)
        for a in range(0, n, step):
            b = min(n, a + step)
            ph = phase[a:b]
            order = np.argsort(ph, kind="stable")
            ends = np.cumsum(np.bincount(ph, minlength=len(self.phases))).tolist()
            from_ = where[a:b][order]
            scratch = self._scratch_rows(b - a)
            lo = 0
            for i, hi in enumerate(ends):
                if hi > lo:  # each row within its phase's array ("clip": straight into out)
                    self.phases[i].take(from_[lo:hi], out=scratch[lo:hi], mode="clip")
                    lo = hi
            back = np.empty(b - a, np.int64)  # where each row of the piece is in the scratch
            back[order] = np.arange(b - a)
            scratch.take(back, out=dest[a:b], mode="clip")

    def _scratch_rows(self, n: int) -> np.ndarray:
        """This thread's scratch, as ``n`` rows."""
        nbytes = n * self._item.itemsize
        buf: np.ndarray | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch.buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(self._item)

    def __getitem__(self, rows: slice | np.ndarray) -> np.ndarray:
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(len(self)), dtype=np.int64)
        return self.take(np.asarray(rows, np.int64))


class ChunkHeap:
    """The values of a ragged or sparse top's heap stored in one mapped file in chunks of whole
    values, indexed by value: what the ragged gather copies a batch's rows out of (it calls
    :meth:`copy_many`, :func:`~.._blocks.copy_all`), where a heap held as one array is copied
    by :func:`~.._blocks.copy_runs`.

    Value ``v`` is the ``value_bytes`` bytes at ``at[k] + (v - k * chunk_values) * value_bytes``
    of the mapping, ``k = v // chunk_values`` its chunk: at ``delta[k] + v * value_bytes``,
    ``delta[k] = at[k] - k * chunk_values * value_bytes``, the same for every chunk of a run
    of chunks that follow each other in the file, each starting where the one before it ends
    (HDF5 writes a dataset's chunks so when it writes them in one go). A run of values (a row's)
    is one span of the mapping's bytes when its chunks lie in one such run (:attr:`run`), and
    is cut at the ends of its chunks where not (the chunk index's nodes or other data
    between two chunks, chunks written out of order). Spans are copied as bytes (whole values
    each), so a chunk need not lie at an offset aligned for the values' dtype."""

    def __init__(
        self,
        whole: np.ndarray,
        at: np.ndarray,
        chunk_values: int,
        n: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
    ) -> None:
        """``whole``: the mapping's bytes (uint8, read-only); ``at``: where each stored chunk
        starts in it (int64, in value order); ``n`` values of ``dtype`` and trailing
        ``shape``."""
        self.dtype = np.dtype(dtype)
        self.shape = (n, *shape)
        self.value_bytes = vb = self.dtype.itemsize * math.prod(shape)
        at = np.asarray(at, np.int64)
        assert vb > 0 and chunk_values > 0 and len(at) * chunk_values >= n
        self._bytes = whole
        self.chunk_values = chunk_values
        #: Where value ``v`` of chunk ``k`` lies: ``delta[k] + v * value_bytes``.
        self.delta = at - np.arange(len(at), dtype=np.int64) * (chunk_values * vb)
        #: The run of chunks back to back in the file that chunk ``k`` is in (a number that
        #: grows with ``k``): values in chunks ``k`` to ``j`` are one span iff ``run[k] ==
        #: run[j]``. Equal ``delta`` at both ends is not enough: chunks 0, 5, 2 written in that
        #: order put chunk 2 at chunk 0's ``delta``, chunk 5 where chunk 1 would be.
        self.run = np.cumsum(run_starts(at, chunk_values * vb))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """The bytes of its values (as an array's: what the pipeline sizes its groups by)."""
        return self.shape[0] * self.value_bytes

    def copy_into(
        self, dest: np.ndarray, start: np.ndarray, at: np.ndarray, count: np.ndarray
    ) -> None:
        """Copy values ``start[i] : start[i] + count[i]`` to ``dest[at[i] : at[i] +
        count[i]]`` for every run ``i`` (int64 arrays), as :func:`~.._blocks.copy_runs` does
        from an array: ``dest`` C-contiguous, of this heap's dtype and trailing shape."""
        self.copy_many([self], [dest], start, at, count)

    def copy_many(
        self,
        heaps: Sequence[ScatteredValues],
        dests: Sequence[np.ndarray],
        start: np.ndarray,
        at: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """:meth:`copy_into` for several heaps (each a :class:`ChunkHeap`) sharing their runs,
        each into its ``dests`` entry: a sparse top's values and column indices. Heaps of values
        of one size in chunks of as many values are copied together: their runs cut once (where
        any of them must be) and their blocks placed once (:func:`~.._blocks.copy_runs` with a
        start per heap)."""
        keep = count > 0
        if not keep.all():
            start, at, count = start[keep], at[keep], count[keep]
        if len(count) == 0:
            return
        alike: dict[tuple[int, int], list[tuple[ChunkHeap, np.ndarray]]] = {}
        for heap, dest in zip(heaps, dests, strict=True):
            assert isinstance(heap, ChunkHeap) and dest.dtype == heap.dtype
            assert dest.flags.c_contiguous
            alike.setdefault((heap.value_bytes, heap.chunk_values), []).append((heap, dest))
        for (vb, c), pairs in alike.items():
            lo, dst, n = start, at, count
            k = lo // c
            last = (lo + n - 1) // c
            cross = np.flatnonzero(k != last)  # runs over a chunk end: in one span?
            if len(cross):
                apart = np.zeros(len(cross), bool)
                for heap, _ in pairs:
                    apart |= heap.run[k[cross]] != heap.run[last[cross]]
                if apart.any():
                    lo, dst, n, k = _cut(lo, dst, n, k, last, cross[apart], c)
            copy_runs(
                [h._bytes for h, _ in pairs],
                [d.reshape(-1).view(np.uint8) for _, d in pairs],
                [h.delta[k] + lo * vb for h, _ in pairs],
                dst * vb,
                n * vb,
                grain=vb,
            )

    def __getitem__(self, values: slice) -> np.ndarray:
        """Values ``values`` (a step of 1), copied out."""
        a, b, step = values.indices(len(self))
        assert step == 1
        out = np.empty((max(0, b - a), *self.shape[1:]), self.dtype)
        self.copy_into(out, np.array([a], np.int64), np.zeros(1, np.int64), np.array([len(out)]))
        return out


def _cut(
    start: np.ndarray,
    at: np.ndarray,
    count: np.ndarray,
    k: np.ndarray,
    last: np.ndarray,
    which: np.ndarray,
    c: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of values (``start``, to ``at``, ``count``, in chunks ``k`` to ``last`` of ``c``
    values) with runs ``which`` cut at the end of every chunk they lie in: each run's (piece's)
    start, place, count and chunk (the pieces after the runs left whole)."""
    m = last[which] - k[which] + 1
    run = np.repeat(which, m)
    chunk = np.arange(int(m.sum()), dtype=np.int64) - np.repeat(np.cumsum(m) - m, m)
    chunk += k[run]
    lo = np.maximum(start[run], chunk * c)
    hi = np.minimum(start[run] + count[run], chunk * c + c)
    whole = np.ones(len(start), bool)
    whole[which] = False
    return (
        np.concatenate((start[whole], lo)),
        np.concatenate((at[whole], at[run] + lo - start[run])),
        np.concatenate((count[whole], hi - lo)),
        np.concatenate((k[whole], chunk)),
    )


class Spliced:
    """One top's rows over several mapped files, indexed by global row: what the gather takes
    rows from when a source of several files is mapped (it calls :meth:`take`, as
    ``np.take`` does on an object that has one; :func:`len` bounds the rows it may ask for).

    A batch whose rows are all in one file is one ``np.take``; one spread over several files
    is taken file by file into its places in ``out``."""

    def __init__(self, parts: Sequence[np.ndarray | ChunkRows], starts: list[int]) -> None:
        self.parts = parts
        self.starts = np.asarray(starts, np.int64)
        self.ends = self.starts + np.asarray([len(p) for p in parts], np.int64)
        self.dtype = parts[0].dtype
        self.shape = (int(self.ends[-1]), *parts[0].shape[1:])

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def nbytes(self) -> int:
        """The bytes of its rows (as an array's: what the pipeline sizes its groups by)."""
        return sum(int(p.nbytes) for p in self.parts)

    def take(
        self, indices: np.ndarray, axis: int = 0, out: np.ndarray | None = None, mode: str = "clip"
    ) -> np.ndarray:
        """``np.take(rows, indices, axis=0, out=out)`` over the files' rows (every index a row:
        the pipeline checks them)."""
        assert axis == 0 and out is not None
        idx = np.asarray(indices, np.int64)
        if len(idx) == 0:
            return out
        part = np.searchsorted(self.ends, idx, side="right")
        first, last = int(part.min()), int(part.max())
        if first == last:
            self.parts[first].take(idx - self.starts[first], axis=0, out=out, mode="clip")
            return out
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(first, last + 2))
        for k in range(first, last + 1):
            where = order[bounds[k - first] : bounds[k - first + 1]]
            if len(where):
                out[where] = self.parts[k][idx[where] - self.starts[k]]
        return out

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(len(self))
        idx = np.arange(start, stop, step, dtype=np.int64)
        out = np.empty((len(idx), *self.shape[1:]), self.dtype)
        return self.take(idx, out=out)


if TYPE_CHECKING:  # both are what the gather takes rows from (mypy checks that they are Rows)
    _ROWS: tuple[type[Rows], ...] = (ChunkRows, Spliced)
    _HEAPS: tuple[type[ScatteredValues], ...] = (ChunkHeap,)
