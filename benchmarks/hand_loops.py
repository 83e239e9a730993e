"""Hand-written streaming loaders, the bars the layer is held to in ``ceilings`` and ``tabular``:
a chunk loop on one thread, the same on two (the next chunk read meanwhile), and a mapped loop.

Each keeps its files open over several epochs and times them as :class:`LayerRun` does a layer's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.data import DatasetFiles
from benchmarks.layer_runs import Array, EpochMeter, LayerRun
from benchmarks.sources import H5Rows


def serve_chunk(
    slot: Sequence[Array], outs: Sequence[Array], perm: Array, b: int, meter: EpochMeter
) -> None:
    """The batches of one chunk in ``slot`` (a top each), in the order ``perm``: ``np.take``
    into the reused buffers ``outs``."""
    for start in range(0, len(perm), b):
        idx = perm[start : start + b]
        for src, out in zip(slot, outs, strict=True):
            np.take(src, idx, axis=0, out=out[: len(idx)], mode="clip")
        meter.batch(len(idx))


def chunk_loop_epochs(
    files: DatasetFiles, b: int, cs: int, seed: int, epochs: int, *, mapped: bool = False
) -> LayerRun:
    """``baselines.chunk_loop`` kept open over several epochs: chunks of ``cs`` in a random
    order, ``read_direct`` each, permute it, ``np.take`` per batch (no batch crosses chunks).

    ``mapped``: the same without the copy out of the page cache: each contiguous dataset mapped
    (``np.memmap``), each batch gathered straight from the mapping. What a loader could reach by
    mapping its files, which asynchdf5 does not do: a file truncated under a mapping kills the
    process (SIGBUS) instead of raising. One file, contiguous data sets only."""
    n = files.spec.samples
    cs = min(cs, n)
    rng = np.random.default_rng(seed)
    run = LayerRun()
    t0 = time.perf_counter()
    tops = [H5Rows(files, top) for top in ("data", "label")]
    try:
        chunk: Callable[[int, int], list[Array]]
        if mapped:
            maps = mappings(files, tops)

            def chunk(c: int, stop: int) -> list[Array]:
                return [m[c:stop] for m in maps]

        else:
            slots = [rows.empty(cs) for rows in tops]

            def chunk(c: int, stop: int) -> list[Array]:
                for rows, slot in zip(tops, slots, strict=True):
                    rows.read_direct(c, stop, slot)
                return slots

        outs = [rows.empty(b) for rows in tops]
        for e in range(epochs):
            meter = EpochMeter(run, t0 if e == 0 else None)
            for c in rng.permutation(range(0, n, cs)):
                stop = min(int(c) + cs, n)
                serve_chunk(chunk(int(c), stop), outs, rng.permutation(stop - int(c)), b, meter)
            meter.end(n)
    finally:
        for rows in tops:
            rows.close()
    return run


def mappings(files: DatasetFiles, tops: Sequence[H5Rows]) -> list[Array]:
    """Each top's contiguous dataset in the one file, mapped read-only."""
    if len(files.paths) != 1:
        raise ValueError("the mapped loop reads one file")
    maps: list[Array] = []
    for rows in tops:
        offset = rows.dsets[0].id.get_offset()
        if offset is None:
            raise ValueError("the mapped loop reads contiguous data sets only")
        maps.append(np.memmap(files.paths[0], rows.dtype, "r", int(offset), rows.shape))
    return maps


def chunk_loop2_epochs(files: DatasetFiles, b: int, cs: int, seed: int, epochs: int) -> LayerRun:
    """The chunk loop on two threads, as a skilled user would pipeline it by hand: while the
    main thread gathers the batches of one chunk, a second thread reads the next chunk into the
    other of two slots with ``os.preadv`` (which releases the GIL) at each contiguous dataset's
    file offset. Contiguous data sets only."""
    n = files.spec.samples
    cs = min(cs, n)
    rng = np.random.default_rng(seed)
    run = LayerRun()
    t0 = time.perf_counter()
    tops = [H5Rows(files, top) for top in ("data", "label")]
    fds = [os.open(p, os.O_RDONLY) for p in files.paths]
    try:
        where = []  # per top: (offset, row bytes) per file
        for rows in tops:
            offs = [d.id.get_offset() for d in rows.dsets]
            if any(o is None for o in offs):
                raise ValueError("the 2-thread chunk loop reads contiguous data sets only")
            row_bytes = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.dtype.itemsize
            where.append(([int(o) for o in offs], row_bytes))

        def read(c: int, slot: list[Array]) -> None:
            stop = min(c + cs, n)
            for rows, out, (offs, rb) in zip(tops, slot, where, strict=True):
                flat = out.reshape(-1).view(np.uint8)
                for f in range(len(rows.dsets)):
                    lo, hi = max(c, int(rows.starts[f])), min(stop, int(rows.starts[f + 1]))
                    if lo < hi:
                        dst = flat[(lo - c) * rb : (hi - c) * rb].data
                        at = offs[f] + (lo - int(rows.starts[f])) * rb
                        while len(dst):
                            got = os.preadv(fds[f], [dst], at)
                            dst, at = dst[got:], at + got

        slots = [[rows.empty(cs) for rows in tops] for _ in range(2)]
        outs = [rows.empty(b) for rows in tops]
        with ThreadPoolExecutor(1, thread_name_prefix="chunk-loop-read") as pool:
            for e in range(epochs):
                meter = EpochMeter(run, t0 if e == 0 else None)
                order = [int(c) for c in rng.permutation(range(0, n, cs))]
                pending = pool.submit(read, order[0], slots[0])
                for k, c in enumerate(order):
                    pending.result()
                    if k + 1 < len(order):
                        pending = pool.submit(read, order[k + 1], slots[(k + 1) % 2])
                    perm = rng.permutation(min(c + cs, n) - c)
                    serve_chunk(slots[k % 2], outs, perm, b, meter)
                meter.end(n)
    finally:
        for fd in fds:
            os.close(fd)
        for rows in tops:
            rows.close()
    return run
