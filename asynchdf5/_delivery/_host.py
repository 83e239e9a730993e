"""Host delivery: batches of NumPy arrays, gathered in groups into a pool of reused buffers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .._batch import Batch, GroupSpec, gather_rows, merge_pieces, split_pieces
from .._catalog import TopInfo
from .._stats import GatherStats
from .._transform import apply_transformers
from ..transforms import Transformer

__all__ = ["PARALLEL_BYTES", "BatchBuffers", "HostDelivery"]

#: Below this many bytes a group is gathered on one thread: handing half to another thread costs
#: more than it saves (and the two would contend for the GIL between small copies).
PARALLEL_BYTES = 2 * 2**20


def _refcounts_are_reliable() -> bool:
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


class BatchBuffers:
    """A pool of preallocated batch buffers, one array per top, reused once nobody holds them.

    A buffer goes back into use only when the pool holds the last reference to it: a batch (or
    any view of its arrays) that the consumer keeps is never overwritten. When every buffer is
    held, a fresh one is allocated, and kept for reuse while the pool has fewer than ``depth``.
    """

    def __init__(self, tops: Mapping[str, TopInfo], rows: int, depth: int) -> None:
        self._tops = list(tops.values())
        self._rows = rows
        self._depth = depth
        self._pool: list[dict[str, np.ndarray]] = []
        self._lock = threading.Lock()
        self._reuse = _refcounts_are_reliable()
        self._next = 0  # round-robin: the oldest buffer is the likeliest to be free

    def _new(self) -> dict[str, np.ndarray]:
        return {t.name: np.empty((self._rows, *t.sample_shape), t.dtype) for t in self._tops}

    def acquire(self, rows: int) -> dict[str, np.ndarray]:
        """Arrays of ``rows`` rows per top (views of a pooled buffer when one is free)."""
        with self._lock:
            if self._reuse:
                n = len(self._pool)
                for i in range(n):
                    bufs = self._pool[(self._next + i) % n]
                    if _unreferenced(bufs):
                        self._next = (self._next + i + 1) % n
                        return _rows(bufs, rows)
                if len(self._pool) < self._depth:
                    bufs = self._new()
                    self._pool.append(bufs)
                    return _rows(bufs, rows)
        return _rows(self._new(), rows)


def _unreferenced(bufs: dict[str, np.ndarray]) -> bool:
    """Whether the pool holds the only reference to each array (so no batch or view uses it)."""
    # Two references each: the pool's dict, and getrefcount's own argument.
    return all(sys.getrefcount(bufs[name]) <= 2 for name in bufs)


def _rows(bufs: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    if rows == len(next(iter(bufs.values()))):
        return dict(bufs)
    return {k: v[:rows] for k, v in bufs.items()}


class HostDelivery:
    """Batches of NumPy arrays in host memory; the transformers run on them after gathering."""

    #: Small batches cost Python work per group, not per batch: big groups (bounded in bytes by
    #: the pipeline's GROUP_BYTES). 256 against 64: 7-9 µs a batch against 13-15 for tiny
    #: batches (batch 32 of 24-byte rows, consumer does nothing); 1024 gained nothing more.
    group_batches = 256

    def __init__(self, transformers: Sequence[tuple[str, Transformer]]) -> None:
        self.transformers = list(transformers)
        self._buffers: BatchBuffers | None = None
        self._shape: tuple[int, int] | None = None

    def check(self, tops: Mapping[str, TopInfo]) -> None:
        """Host memory holds every dtype a top may have."""

    def start(self, tops: Mapping[str, TopInfo], group_rows: int, depth: int) -> None:
        if self._buffers is None or self._shape != (group_rows, depth):
            self._buffers = BatchBuffers(tops, group_rows, depth)
            self._shape = (group_rows, depth)

    def make(
        self, group: GroupSpec, stats: GatherStats, helper: Executor | None
    ) -> tuple[list[Batch], Exception | None]:
        """Gather and transform ``group`` (blocking; runs in a worker thread).

        Returns the batches and ``None`` or, when a batch fails, the complete batches before it
        and the error, so that those are still delivered ahead of the error. The whole group is
        gathered into one buffer, with one ``take`` per top per run of rows (per-batch Python
        work is what limits small batches); the batches are views of it. With a ``helper`` and a
        group of at least ``PARALLEL_BYTES``, half of the rows are gathered on the helper's
        thread (``np.take`` releases the GIL). Transformers always run here, one batch after the
        other: a transformer is never called from two threads at once.
        """
        assert self._buffers is not None, "start() first"
        t0 = time.perf_counter()
        total = group.rows
        arrays = self._buffers.acquire(total)
        indices = np.empty(total, np.int64)
        pieces = merge_pieces(group.pieces)
        nbytes = sum(a.nbytes for a in arrays.values())
        future = None
        at = 0
        if helper is not None and nbytes >= PARALLEL_BYTES:
            head, pieces = split_pieces(pieces, total // 2)
            future = helper.submit(gather_rows, head, arrays, indices)
            at = total // 2
        try:
            gather_rows(pieces, arrays, indices, at)
        finally:
            if future is not None:
                future.result()
        out: list[Batch] = []
        error: Exception | None = None
        at = 0
        transformers = self.transformers
        transforming = 0.0  # only the transformers' own calls: cutting batches is gathering
        for size, epoch in zip(group.sizes, group.epochs, strict=True):
            end = at + size
            data: dict[str, Any] = {k: v[at:end] for k, v in arrays.items()}
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
            out.append(Batch(data, rows, epoch))
        stats.gather_seconds += time.perf_counter() - t0 - transforming
        stats.transform_seconds += transforming
        return out, error

    def hand_off(self, batch: Batch) -> None:
        """Nothing to do: host arrays are ready when gathered."""

    def memory(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._buffers = None
        self._shape = None
