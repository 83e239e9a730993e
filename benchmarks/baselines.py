"""Baselines: the raw-read and in-RAM limits, and the loaders people write with plain h5py.

Every function here is a measurement (``f(job) -> Outcome``) run in its own subprocess by
:mod:`benchmarks.measure`. Shuffled loaders draw their order from ``np.random.default_rng(seed)``.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
import numpy.typing as npt

from asynchdf5._cli._limits import gather_epoch, read_ranges, stored_ranges_of
from benchmarks.data import TOPS
from benchmarks.measure import EpochClock, Job, Outcome, Skip
from benchmarks.sources import H5Rows

# --------------------------------------------------------------------------------------------
# Limits


def raw_read(job: Job) -> Outcome:
    """Read the data set's bytes (every top, as stored) with large ``os.preadv`` calls
    (:func:`asynchdf5._cli._limits.read_ranges`, the loop ``asynchdf5 bench`` runs too).

    params: ``buffer_mib`` (size of the one reused buffer, hence of each call). A warm run (the
    files were read once before it) keeps the best of three passes, being a limit; a cold one
    (after ``posix_fadvise(DONTNEED)``) is one pass.
    """
    buffer = memoryview(bytearray(job.params.get("buffer_mib", 64) << 20))
    ranges = stored_ranges_of([str(p) for p in job.files.paths], TOPS)
    passes: list[tuple[float, float]] = []
    for _ in range(1 if job.cold else 3):
        t0 = time.perf_counter()
        total, first = read_ranges(ranges, buffer)
        passes.append((time.perf_counter() - t0, first))
    elapsed, first = min(passes)
    n = job.files.spec.samples
    return Outcome(
        samples_per_s=n / elapsed,
        epoch_s=elapsed,
        first_batch_s=first,
        timed_samples=n,
        bytes_per_s=total / elapsed,
        extra={"bytes": total, "ranges": len(ranges), "passes": [p[0] for p in passes]},
    )


def _decompressor(codec: str, size: int) -> Callable[[bytes], object]:
    if codec == "zlib":
        return zlib.decompress
    if codec == "isal":
        try:
            from isal import isal_zlib
        except ImportError as exc:
            raise Skip("isal is not installed") from exc
        return isal_zlib.decompress
    if codec == "deflate":
        try:
            import deflate
        except ImportError as exc:
            raise Skip("deflate is not installed") from exc
        return lambda b: deflate.zlib_decompress(b, size)
    raise ValueError(f"unknown codec {codec!r}")


def decompress(job: Job) -> Outcome:
    """Decompress the ``data`` top's stored gzip chunks in a pool of threads (no I/O timed).

    params: ``codec`` (``zlib``, ``isal`` or ``deflate``), ``threads``, ``max_chunks``. This is the
    decompression limit of the gzip set: the rate at which an ideal reader could turn stored chunks
    into samples on this many cores.
    """
    path, top = job.files.paths[0], "data"
    with h5py.File(path, "r") as f:
        dset = f[top]
        if dset.compression != "gzip":
            raise Skip("not a gzip data set")
        chunk_rows = dset.chunks[0]
        n_chunks = min(dset.id.get_num_chunks(), job.params.get("max_chunks", 128))
        raw = [dset.id.read_direct_chunk((i * chunk_rows, 0, 0, 0))[1] for i in range(n_chunks)]
        chunk_bytes = chunk_rows * int(np.prod(dset.shape[1:])) * dset.dtype.itemsize
    fn = _decompressor(job.params["codec"], chunk_bytes)
    threads = int(job.params["threads"])
    fn(raw[0])  # first call outside the timing: imports, allocator warm-up
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(fn, raw))
        elapsed = time.perf_counter() - t0
    out_bytes = n_chunks * chunk_bytes
    samples = n_chunks * chunk_rows
    rate = samples / elapsed
    return Outcome(
        samples_per_s=rate,
        epoch_s=job.files.spec.samples / rate,
        first_batch_s=None,
        extrapolated=n_chunks * chunk_rows < job.files.spec.samples,
        timed_samples=samples,
        bytes_per_s=out_bytes / elapsed,
        extra={"chunks": n_chunks, "ratio": sum(map(len, raw)) / out_bytes},
    )


def _batches(n: int, batch: int) -> range:
    return range(0, n, batch)


def in_ram(job: Job) -> Outcome:
    """The no-I/O ceiling: every top in RAM, one permutation, ``np.take`` into reused batches
    (:func:`asynchdf5._cli._limits.gather_epoch`, the loop ``asynchdf5 bench`` runs too)."""
    t_load = time.perf_counter()
    arrays = []
    for top in ("data", "label"):
        with H5Rows(job.files, top) as rows:
            arr = rows.empty(len(rows))
            rows.read_direct(0, len(rows), arr)
            arrays.append(arr)
    load_s = time.perf_counter() - t_load
    clock = EpochClock(job.files.spec.samples, None)
    clock.start()
    gather_epoch(arrays, job.batch_size, job.seed, clock.batch)
    return clock.outcome(load_s=load_s)


def chunk_loop(job: Job) -> Outcome:
    """A hand-written single-thread loader: read a chunk with ``read_direct``, permute, take.

    Chunks of ``job.chunk_size`` samples are visited in a random order; a batch does not cross a
    chunk boundary (the last batch of a chunk may be short). No overlap of reading and serving.
    """
    n, b, cs = job.files.spec.samples, job.batch_size, min(job.chunk_size, job.files.spec.samples)
    rng = np.random.default_rng(job.seed)
    clock = EpochClock(n, None)
    clock.start()
    tops = [H5Rows(job.files, top) for top in ("data", "label")]
    try:
        slots = [rows.empty(cs) for rows in tops]
        outs = [rows.empty(b) for rows in tops]
        for c in rng.permutation(range(0, n, cs)):
            stop = min(int(c) + cs, n)
            for rows, slot in zip(tops, slots, strict=True):
                rows.read_direct(int(c), stop, slot)
            perm = rng.permutation(stop - int(c))
            for start in _batches(len(perm), b):
                idx = perm[start : start + b]
                for slot, out in zip(slots, outs, strict=True):
                    np.take(slot, idx, axis=0, out=out[: len(idx)], mode="clip")
                clock.batch(len(idx))
    finally:
        for rows in tops:
            rows.close()
    return clock.outcome()


# --------------------------------------------------------------------------------------------
# Plain h5py


def h5py_slab(job: Job) -> Outcome:
    """Slab reads in order, ``dset[i:i+C]`` per top, served as batches of the slab (no shuffle).

    params: ``slab`` (rows per read, default 65536).
    """
    n, b = job.files.spec.samples, job.batch_size
    slab = int(job.params.get("slab", 65536))
    clock = EpochClock(n, job.budget_s)
    clock.start()
    with H5Rows(job.files, "data") as data, H5Rows(job.files, "label") as label:
        for i in range(0, n, slab):
            x, y = data.slab(i, min(i + slab, n)), label.slab(i, min(i + slab, n))
            for start in _batches(len(x), b):
                _consume(x[start : start + b], y[start : start + b])
                if not clock.batch(len(x[start : start + b])):
                    return clock.outcome(slab=slab)
    return clock.outcome(slab=slab)


def h5py_fancy(job: Job) -> Outcome:
    """One shuffled epoch of sorted fancy-index batches: ``dset[np.sort(batch_indices)]``."""
    n, b = job.files.spec.samples, job.batch_size
    clock = EpochClock(n, job.budget_s)
    clock.start()
    with H5Rows(job.files, "data") as data, H5Rows(job.files, "label") as label:
        perm = np.random.default_rng(job.seed).permutation(n)
        for start in _batches(n, b):
            idx = np.sort(perm[start : start + b])
            _consume(data.fancy(idx), label.fancy(idx))
            if not clock.batch(len(idx)):
                break
    return clock.outcome()


def _consume(*arrays: npt.NDArray[np.generic]) -> None:
    """The consumer that does nothing (kept as a call so every loader pays the same)."""
