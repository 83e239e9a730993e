"""Reads as the layer's reader issues them, for the ``block-size`` benchmark.

Each block is one range, cut at the reader's ``PIECE_BYTES``; ranges are grouped into calls of
about ``PIECE_BYTES``, run on ``READ_THREADS`` threads with ``os.preadv`` into preallocated
buffers (:class:`Reader`); :func:`pass_ranges` draws one timed pass's blocks. Kept apart from
the measurement so that the replayed read path reads on its own, beside the reader it copies.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from benchmarks.internals import PIECE_BYTES

__all__ = ["READ_THREADS", "Reader", "batches", "pass_ranges", "split"]

#: The layer's reader threads (``read_threads`` of :class:`asynchdf5._read.HDF5Reader`).
READ_THREADS = 2


def split(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges no longer than ``PIECE_BYTES`` (the reader cuts contiguous rows so)."""
    out = []
    for offset, length in ranges:
        for a in range(0, length, PIECE_BYTES):
            out.append((offset + a, min(PIECE_BYTES, length - a)))
    return out


def batches(ranges: Sequence[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """Consecutive ranges, about ``PIECE_BYTES`` per batch: one worker-thread call each."""
    batch: list[tuple[int, int]] = []
    size = 0
    for r in ranges:
        if batch and size + r[1] > PIECE_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += r[1]
    if batch:
        yield batch


@dataclass
class Reader:
    """``threads`` threads, each with its own preallocated (and touched) buffer."""

    fd: int
    threads: int = READ_THREADS
    _buffers: list[memoryview] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        for _ in range(self.threads):
            buf = np.ones(PIECE_BYTES, np.uint8)  # touched now, not during a timed pass
            self._buffers.append(memoryview(buf))
        self.pool = ThreadPoolExecutor(self.threads, "block-size-read")

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            with self._lock:
                buf = self._local.buf = self._buffers.pop()
        assert isinstance(buf, memoryview)
        return buf

    def _read(self, batch: list[tuple[int, int]], deadline: float) -> int:
        if time.perf_counter() > deadline:
            return 0
        buf = self._buffer()
        done = 0
        for offset, length in batch:
            got = 0
            while got < length:
                n = os.preadv(self.fd, [buf[got:length]], offset + got)
                if n <= 0:
                    raise OSError(f"short read at byte {offset + got}")
                got += n
            done += length
        return done

    def run(self, ranges: Sequence[tuple[int, int]], max_seconds: float) -> tuple[int, float]:
        """Read the ranges (in order, ``threads`` calls in flight); stop starting new calls after
        ``max_seconds``. Returns (bytes read, seconds)."""
        t0 = time.perf_counter()
        deadline = t0 + max_seconds
        futures = [self.pool.submit(self._read, b, deadline) for b in batches(split(ranges))]
        total = sum(f.result() for f in futures)
        return total, time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


def pass_ranges(
    size: int, block: int | None, nbytes: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """About ``nbytes`` of the file: a sequential stretch from a random offset (``block=None``)
    or blocks of ``block`` bytes, from a random rotation, in a random permutation."""
    nbytes = min(nbytes, size)
    if block is None:
        start = int(rng.integers(0, size - nbytes + 1))
        return [(start, nbytes)]
    shift = int(rng.integers(0, block))
    count = (size - shift) // block
    take = min(count, -(-nbytes // block))
    chosen = rng.permutation(count)[:take]
    return [(shift + int(k) * block, block) for k in chosen]
