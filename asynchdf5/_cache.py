"""Host memory: the cache slots holding whole chunks, and the ring of batch buffers.

Both are allocated once and reused, so a long run's memory stays flat: the slots for every chunk
of every epoch, the batch buffers for every batch once the consumer has let go of them.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ._catalog import TopInfo

__all__ = [
    "N_SLOTS",
    "BatchBuffers",
    "CacheBudgetWarning",
    "Slot",
    "allocate_slots",
    "default_cache_bytes",
    "slot_rows",
]

#: Slots: one being served while the next is read.
N_SLOTS = 2


class CacheBudgetWarning(UserWarning):
    """``chunk_size`` samples per slot would not fit ``cache_bytes``: the chunks were shrunk."""


def default_cache_bytes() -> int:
    """The default budget of the host cache: a third of the machine's physical memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 4 * 2**30


@dataclass(eq=False)
class Slot:
    """One cache slot: an array per top with room for a chunk's samples."""

    index: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def slot_rows(chunk_size: int, shard_samples: int, row_bytes: int, cache_bytes: int) -> int:
    """Rows per slot: ``chunk_size``, no more than the shard holds, shrunk to fit the budget."""
    rows = min(chunk_size, shard_samples)
    fit = cache_bytes // (N_SLOTS * max(1, row_bytes))
    if fit < rows:
        warnings.warn(
            f"chunk_size={chunk_size} samples of {row_bytes} bytes in {N_SLOTS} cache slots "
            f"would take {N_SLOTS * rows * row_bytes / 2**30:.2f} GiB, more than "
            f"cache_bytes={cache_bytes / 2**30:.2f} GiB: using chunks of {max(1, fit)} samples",
            CacheBudgetWarning,
            stacklevel=2,
        )
        rows = max(1, fit)
    return rows


def _anonymous(nbytes: int) -> np.ndarray:
    """Page-aligned anonymous memory, untouched until it is first written.

    No ``MADV_HUGEPAGE``: on this project's machines (2-vCPU VMs) it made the first fill of a slot
    about 4x slower (0.34 vs 1.26 GB/s for ``preadv`` into fresh memory) and later fills about
    30% slower, for a gather gain under 3% (measured with ``/tmp``-style micro-benchmarks,
    2026-11-21; see benchmarks/RESULTS.md).
    """
    if nbytes == 0:
        return np.empty(0, np.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, np.uint8)


def allocate_slots(tops: Mapping[str, TopInfo], rows: int, count: int = N_SLOTS) -> list[Slot]:
    """Allocate the cache slots once; they are reused for every chunk of every epoch."""
    slots = []
    for i in range(count):
        arrays = {}
        for t in tops.values():
            raw = _anonymous(rows * t.row_bytes)
            arrays[t.name] = raw.view(t.dtype).reshape(rows, *t.sample_shape)
        slots.append(Slot(i, arrays))
    return slots


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
