"""Host delivery: batches of NumPy arrays, gathered in groups into a pool of reused buffers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

from .._batch import Batch
from .._catalog import TopInfo
from .._gather import gather_padded, gather_ragged, gather_split
from .._ragged import Ragged, csr_batch, sparse_module
from .._specs import GroupSpec, merge_pieces, split_pieces
from .._stats import GatherStats
from .._transform import apply_transformers, fused_pads
from ..transforms import Pad, Transformer

__all__ = [
    "CACHE_LINE",
    "BatchBuffers",
    "BatchMemory",
    "HostDelivery",
    "aligned_empty",
    "line_offset",
    "ragged_batch",
]


def ragged_batch(top: TopInfo, offsets: np.ndarray, heaps: list[np.ndarray], a: int, b: int) -> Any:
    """Rows ``a:b`` of a ragged top's gathered rows (:func:`~.._gather.gather_ragged`) as a
    batch's value: a :class:`~asynchdf5.Ragged` (views of the gathered arrays, offsets from 0),
    or a sparse top's ``scipy.sparse.csr_array`` (offsets from 0 of the dtype scipy keeps with
    the indices, :attr:`~.._ragged_tops.RaggedInfo.batch_index_dtype`, over views of the
    gathered values and indices: :func:`csr_batch`)."""
    info = top.ragged
    assert info is not None
    o = offsets[a : b + 1]
    lo, hi = int(o[0]), int(o[-1])
    if info.sparse:
        rebased = (o - lo).astype(info.batch_index_dtype, copy=False)
        return csr_batch(heaps[0][lo:hi], heaps[1][lo:hi], rebased, info.n_cols)
    return Ragged._trusted(heaps[0][lo:hi], o - lo)


class HeapBuffers:
    """Reused memory for ragged tops' batch values (:func:`~.._gather.gather_ragged`'s
    ``empty``): a buffer goes back to use once nothing refers to it (no batch, no view of
    one), as :class:`BatchBuffers`' do. A group's values vary in size: a request takes the
    first free buffer large enough, else replaces a free smaller one (a quarter larger than
    asked), else, with ``depth`` buffers in use, gets memory of its own. Fresh memory is slow
    to touch the first time; reused memory is not."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._pool: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._reuse = _refcounts_are_reliable()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            if self._reuse:
                pool = self._pool
                smaller = -1
                for i in range(len(pool)):
                    # Two references when free: the pool's and getrefcount's argument.
                    if sys.getrefcount(pool[i]) <= 2:
                        if len(pool[i]) >= nbytes:
                            return pool[i][:nbytes].view(dtype).reshape(shape)
                        smaller = i
                if smaller >= 0 or len(pool) < self._depth:
                    buf = np.empty(nbytes + nbytes // 4 + 64, np.uint8)
                    if smaller >= 0:
                        pool[smaller] = buf
                    else:
                        pool.append(buf)
                    return buf[:nbytes].view(dtype).reshape(shape)
        return np.empty(shape, dtype)


def _refcounts_are_reliable() -> bool:
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


#: Batch buffers start at the same byte offset within a cache line as the rows gathered into
#: them (see :func:`aligned_empty`).
CACHE_LINE = 64


def line_offset(a: np.ndarray) -> int:
    """Where ``a``'s data starts within a cache line (bytes)."""
    return int(a.__array_interface__["data"][0]) % CACHE_LINE


class BatchMemory(Protocol):
    """Where a pool's batch buffers come from, when not from NumPy: memory another process
    reads the batches from (a DataLoader worker's shared memory, :mod:`asynchdf5.torch`), so
    that batches are gathered where they are sent from, never copied there."""

    #: Groups the consumer may hold beyond a run's own (batches on their way to that process):
    #: the pool keeps as many more buffers.
    held: int

    def empty(self, nbytes: int) -> np.ndarray:
        """A byte array of ``nbytes`` of memory of its own, which views of it refer to as their
        base (NumPy's rule: the first array owning its memory, or whose base is no array), so
        that its reference count says whether a batch still uses it."""
        ...


def aligned_empty(
    nbytes: int, offset: int, memory: BatchMemory | None = None
) -> tuple[np.ndarray, int]:
    """A new byte array (NumPy's, or from ``memory``) with room for ``nbytes`` starting
    ``offset`` bytes into a cache line, and the index of that start.

    Why: copying rows whose source and destination sit at different offsets within their cache
    lines is slower (``memmove`` takes its unaligned path). Cache slots are page-aligned
    (``mmap``); a user's arrays for ``MemoryDataLayer`` are wherever NumPy put them. So batch
    buffers follow their source instead of a fixed alignment.
    """
    size = nbytes + CACHE_LINE
    raw = np.empty(size, np.uint8) if memory is None else memory.empty(size)
    start = (offset - line_offset(raw)) % CACHE_LINE
    return raw, start


class BatchBuffers:
    """A pool of preallocated batch buffers, one array per top, reused once nobody holds them.

    A buffer goes back into use only when the pool holds the last reference to it: a batch (or
    any view of its arrays) that the consumer keeps is never overwritten. When every buffer is
    held, a fresh one is allocated, and kept for reuse while the pool has fewer than ``depth``.
    ``offsets``: per top, the offset within a cache line of the rows gathered into it (see
    :func:`aligned_empty`; 0 for a top not named). ``memory``: where the pooled buffers come
    from (:class:`BatchMemory`; NumPy by default); one allocated beyond the pool is NumPy's.

    The pool keeps each buffer's owning byte array, and hands out typed views of it: NumPy makes
    every view of a view refer to the array that owns the memory, so the owner's reference count
    is what says whether any batch still uses it.
    """

    def __init__(
        self,
        tops: Mapping[str, TopInfo],
        rows: int,
        depth: int,
        offsets: Mapping[str, int] | None = None,
        memory: BatchMemory | None = None,
    ) -> None:
        self._tops = list(tops.values())
        self._rows = rows
        self._depth = depth + (memory.held if memory is not None else 0)
        self._memory = memory
        self._offsets = {t.name: _offset(t, (offsets or {}).get(t.name, 0)) for t in self._tops}
        self._pool: list[dict[str, tuple[np.ndarray, int]]] = []
        self._lock = threading.Lock()
        self._reuse = _refcounts_are_reliable()
        self._next = 0  # round-robin: the oldest buffer is the likeliest to be free

    def _new(self, memory: BatchMemory | None = None) -> dict[str, tuple[np.ndarray, int]]:
        return {
            t.name: aligned_empty(self._rows * t.row_bytes, self._offsets[t.name], memory)
            for t in self._tops
        }

    def _views(self, bufs: dict[str, tuple[np.ndarray, int]], rows: int) -> dict[str, np.ndarray]:
        out = {}
        for t in self._tops:
            raw, start = bufs[t.name]
            flat = raw[start : start + rows * t.row_bytes]
            out[t.name] = flat.view(t.dtype).reshape(rows, *t.sample_shape)
        return out

    def acquire(self, rows: int) -> dict[str, np.ndarray]:
        """Arrays of ``rows`` rows per top (views of a pooled buffer when one is free)."""
        with self._lock:
            if self._reuse:
                n = len(self._pool)
                for i in range(n):
                    bufs = self._pool[(self._next + i) % n]
                    if _unreferenced(bufs):
                        self._next = (self._next + i + 1) % n
                        return self._views(bufs, rows)
                if len(self._pool) < self._depth:
                    bufs = self._new(self._memory)
                    self._pool.append(bufs)
                    return self._views(bufs, rows)
        return self._views(self._new(), rows)


def _offset(top: TopInfo, offset: int) -> int:
    """``offset``, lowered to a multiple of the dtype's alignment (a typed view must be aligned)."""
    align = max(1, top.dtype.alignment)
    return offset - offset % align


def _unreferenced(bufs: dict[str, tuple[np.ndarray, int]]) -> bool:
    """Whether the pool holds the only reference to each owner (so no batch or view uses it)."""
    # Two references each: the pool's tuple, and getrefcount's own argument (no name is bound to
    # the owner here: a loop variable would be a third).
    return all(sys.getrefcount(entry[0]) <= 2 for entry in bufs.values())


class HostDelivery:
    """Batches of NumPy arrays in host memory; the transformers run on them after gathering.

    A ragged top whose chain starts with a :class:`~asynchdf5.transforms.Pad` of a given length
    is gathered padded instead (:func:`~.._transform.fused_pads`): its batch is what that Pad
    would have made, and the rest of the chain runs on it."""

    #: Small batches cost Python work per group, not per batch: big groups (bounded in bytes by
    #: the pipeline's GROUP_BYTES) make tiny batches cheaper; much bigger ones gain nothing more.
    group_batches = 256

    def __init__(self, transformers: Sequence[tuple[str, Transformer]]) -> None:
        self.transformers = list(transformers)
        #: Where batch buffers come from (None: NumPy); set before a run starts.
        self.batch_memory: BatchMemory | None = None
        self._ragged: dict[str, TopInfo] = {}
        #: The ragged tops gathered padded (not in ``_ragged``), every top in the tops'
        #: order, and the chain left to run on the batches (set by start()).
        self._padded: dict[str, Pad] = {}
        self._order: list[str] = []
        self._chain: list[tuple[str, Transformer]] = list(transformers)
        #: The chain without the Pads that fuse on a ragged top: the user's code, whatever the
        #: tops turn out to be (a Pad left in the chain, on a top that is not ragged, is the
        #: layer's own code and may run on two threads).
        self._user_chain = fused_pads(self.transformers, None)[1]
        self._heaps: HeapBuffers | None = None
        self._buffers: BatchBuffers | None = None
        self._shape: tuple[int, int, dict[str, int], BatchMemory | None] | None = None

    @property
    def runs_user_code(self) -> bool:
        return bool(self._user_chain)

    @property
    def concurrent(self) -> bool:
        """Groups gather on two threads at once, but a transformer is never called from two
        (a chain of fused Pads alone gathers as no chain does)."""
        return not self._user_chain

    @property
    def per_batch(self) -> bool:
        """Transformed batches go to the consumer one by one, as each is transformed."""
        return bool(self._user_chain)

    def check(self, tops: Mapping[str, TopInfo]) -> None:
        """Host memory holds every dtype a top may have; a sparse-matrix top's batches need
        scipy, imported here (blocking, at open: :func:`~.._ragged.sparse_module`)."""
        for name, top in tops.items():
            if top.ragged is not None and top.ragged.sparse:
                sparse_module(name)

    def start(
        self,
        tops: Mapping[str, TopInfo],
        group_rows: int,
        depth: int,
        offsets: Mapping[str, int] | None = None,
    ) -> None:
        shape = (group_rows, depth, dict(offsets or {}), self.batch_memory)
        # Ragged tops' batch values are gathered per group into buffers of a pool (HeapBuffers).
        ragged = {k: t for k, t in tops.items() if t.ragged is not None}
        dense = {k: t.dtype for k, t in ragged.items() if t.ragged and not t.ragged.sparse}
        self._padded, self._chain = fused_pads(self.transformers, dense)
        self._ragged = {k: t for k, t in ragged.items() if k not in self._padded}
        self._order = list(tops)  # a batch's keys: the tops' order, whatever their kind
        if ragged and (self._heaps is None or self._shape != shape):
            self._heaps = HeapBuffers(
                depth * sum(2 if t.ragged.sparse else 1 for t in ragged.values() if t.ragged)
            )
        if self._buffers is None or self._shape != shape:
            fixed = {k: t for k, t in tops.items() if t.ragged is None}
            self._buffers = BatchBuffers(fixed, group_rows, depth, offsets, self.batch_memory)
            self._shape = shape

    def make(
        self,
        group: GroupSpec,
        stats: GatherStats,
        helper: Executor | None,
        emit: Callable[[Batch], None] | None = None,
    ) -> tuple[list[Batch], Exception | None]:
        """Gather and transform ``group`` (blocking; runs in a worker thread).

        Returns the batches and ``None`` or, when a batch fails, the complete batches before it
        and the error, so that those are still delivered ahead of the error. The whole group is
        gathered into one buffer, with one ``take`` per top per run of rows (per-batch Python
        work is what limits small batches); the batches are views of it. With a ``helper`` and a
        group of at least ``_gather.PARALLEL_BYTES``, half of the rows (of a ragged top: of its
        values) are gathered on the helper's thread (``np.take`` releases the GIL). Transformers
        always run here, one batch after the other: a transformer is never called from two
        threads at once; ``emit`` gets each batch once its transformers are done (and the
        returned list leaves it out).
        """
        assert self._buffers is not None, "start() first"
        t0 = time.perf_counter()
        total = group.rows
        arrays = self._buffers.acquire(total)
        indices = np.empty(total, np.int64)
        pieces = merge_pieces(group.pieces)
        if group.schemas is None:
            gather_split(pieces, arrays, indices, helper)
        else:  # streams of different schemas (:mod:`.._schemas`): each run its own arrays
            at = first = 0
            for count, names in group.schemas:
                n = sum(group.sizes[first : first + count])
                head, pieces = split_pieces(pieces, n)
                dest = {i: arrays[i][at : at + n] for i in names.values()}
                gather_split(head, dest, indices[at : at + n], helper)
                at, first = at + n, first + count
        empty = self._heaps.empty if self._heaps is not None else None
        padded = {
            name: gather_padded(pieces, name, pad.length, pad.pad, empty, helper)
            for name, pad in self._padded.items()
            if pad.length is not None
        }
        ragged = {
            name: (t, *gather_ragged(pieces, name, t.ragged.sparse, empty, helper))
            for name, t in self._ragged.items()
            if t.ragged is not None
        }
        for name, (t, offsets, heaps) in ragged.items():
            if t.ragged is not None and t.ragged.sparse:
                t.ragged.check_columns(name, heaps[1], offsets, indices)
        each = group.batch_tops()
        out: list[Batch] = []
        error: Exception | None = None
        at = 0
        transformers = self._chain
        transforming = 0.0  # only the transformers' own calls: cutting batches is gathering
        for i, (size, epoch) in enumerate(zip(group.sizes, group.epochs, strict=True)):
            end = at + size
            fixed = (
                {k: v[at:end] for k, v in arrays.items()}
                if each is None
                else {top: arrays[internal][at:end] for top, internal in each[i].items()}
            )
            data: dict[str, Any] = {}
            # In the tops' order; a stream of its own tops (:mod:`.._schemas`): in its order.
            for name in self._order if each is None else (*each[i], *self._order):
                if name in padded:
                    data[name] = padded[name][at:end]
                elif name in ragged:
                    t, offsets, heaps = ragged[name]
                    data[name] = ragged_batch(t, offsets, heaps, at, end)
                elif name in fixed:
                    data[name] = fixed.pop(name)
            data.update(fixed)
            rows = indices[at:end]
            at = end
            if transformers:
                t1 = time.perf_counter()
                try:
                    apply_transformers(data, transformers, epoch, rows)
                except Exception as exc:
                    error = exc
                    break
                finally:
                    transforming += time.perf_counter() - t1
            batch = Batch(data, rows, epoch)
            if emit is None:
                out.append(batch)
                continue
            try:
                emit(batch)
            except Exception as exc:  # not handed over: not among those made
                error = exc
                break
            del batch, data  # handed over: the consumer holds the only reference
        stats.gather_seconds += time.perf_counter() - t0 - transforming
        stats.transform_seconds += transforming
        return out, error

    def hand_off(self, batch: Batch) -> None:
        """Nothing to do: host arrays are ready when gathered."""

    def memory(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._buffers = None
        self._heaps = None
        self._shape = None
