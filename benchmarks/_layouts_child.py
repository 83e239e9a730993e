"""The readers of the ``layouts`` benchmark, in one child process per mode:
``python -m benchmarks._layouts_child JOB.json RESULT.json``.

The child imports what the readers need, joins the memory cgroup named in the job (if any), then,
for each layout of the job, runs the readers one after the other, ``rounds`` times (so that
reference and layer alternate): ``cold`` evicts the layout's files before each reader. Every batch
is touched (one value of each sample summed) so that no lazy path is flattered.

- ``raw``: one thread, ``os.preadv`` of the layout's stored bytes (every chunk, or the contiguous
  extent; adjacent ranges merged) in pieces of at most 8 MiB into one buffer: the read limit of
  the same bytes.
- ``raw_fresh``: (warm only) the same reads into memory never written before that holds them
  all (each piece faulted in first, as the layer's resident reads are): the least a resident
  data set's first epoch costs, beside its gather; on one thread, and on as many as the layer
  reads a resident data set on (``fill_threads``, the pieces dealt out in turn).
- ``h5py``: what a user writes, ``dset[i:i + 256]`` of every top, in order.
- ``decode``: (filtered layouts, warm only) the stored chunks, already in memory, decoded by
  ``asynchdf5``'s own decoder on as many threads as there are cores, one executor task per
  chunk: the decode limit as first defined. The task machinery costs about as much CPU per
  chunk as a small chunk's inflate, so it is a loose limit; kept beside ``decode_loop`` so
  that older figures can be compared.
- ``decode_loop``: (filtered layouts, warm only) the same chunks (held in bytearrays, as the
  reader's buffers are) decoded by the same decoder calls, by one thread per core, each
  looping over its share into one reused buffer, with nothing per chunk but the decode: the
  fastest decode of these chunks this machine does, the decode limit the layer is held to.
- ``decode_fresh``: (filtered layouts, warm only) as ``decode``, but each chunk's rows placed
  where a resident data set holds them, in memory never written before (the reader's own runs of
  chunks, each place faulted in first, as the layer does): the least a resident data set's
  first epoch costs, beside its reads and its gather.
- ``layer``: a fresh :class:`asynchdf5.AsyncHDF5DataLayer` (shuffled, batch 256, default
  properties), epochs 1 and 2, the time from its construction to the first batch, and whether
  it held the data set resident (its epoch 2 then gathers from memory, reading nothing).
- ``layer_backed``: (warm only) the same, right after this process wrote and freed as much
  memory as the data set (:func:`back`), so that the layer's first epoch writes pages the host
  backs. A VM whose balloon reports freed memory to the host (free page reporting) makes the
  first write to a page the host took back cost a host fault (``page_costs``); a machine whose
  memory stays backed (bare metal, most cloud VMs) never pays it. Both are reported.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

BATCH = 256
PIECE = 8 * 2**20
TOPS = ("data", "label")


def _stored(paths: list[str]) -> tuple[list[tuple[str, int, int]], Any]:
    """The tops' stored byte ranges (merged where adjacent) and the catalog."""
    from asynchdf5._catalog import build_catalog
    from asynchdf5._cli._limits import stored_ranges
    from asynchdf5._sources import LocalSource

    source = LocalSource()
    try:
        catalog = build_catalog(source, paths, TOPS)
        return stored_ranges(catalog), catalog
    finally:
        source.close()


def raw(paths: list[str], n: int) -> dict[str, Any]:
    ranges, _ = _stored(paths)
    buf = bytearray(PIECE)
    view = memoryview(buf)
    fds = {p: os.open(p, os.O_RDONLY) for p in {r[0] for r in ranges}}
    try:
        t0 = time.perf_counter()
        total = 0
        for name, offset, size in ranges:
            at = 0
            while at < size:
                got = os.preadv(fds[name], [view[: min(PIECE, size - at)]], offset + at)
                if got <= 0:
                    raise OSError(f"{name}: short read at {offset + at}")
                at += got
            total += size
        seconds = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"rate": n / seconds, "seconds": seconds, "bytes": total}


def raw_fresh(paths: list[str], n: int, threads: int = 1) -> dict[str, Any]:
    """As :func:`raw`, into memory never written before that holds every byte (each piece
    faulted in first, as the layer does): what reading a resident data set in costs at least;
    ``threads`` read the pieces, dealt out in turn."""
    import mmap

    from asynchdf5._pages import populate

    ranges, _ = _stored(paths)
    total = sum(size for _, _, size in ranges)
    pieces: list[tuple[str, int, int, int]] = []  # (file, offset, size, where in memory)
    at = 0
    for name, offset, size in ranges:
        for done in range(0, size, PIECE):
            pieces.append((name, offset + done, min(PIECE, size - done), at))
            at += min(PIECE, size - done)
    fds = {p: os.open(p, os.O_RDONLY) for p in {r[0] for r in ranges}}
    memory = mmap.mmap(-1, max(1, total), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(memory)

    def read(k: int) -> None:
        for name, offset, size, where in pieces[k::threads]:
            piece = view[where : where + size]
            populate(piece)
            got = os.preadv(fds[name], [piece], offset)
            piece.release()
            if got != size:
                raise OSError(f"{name}: short read at {offset}")

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        seconds = time.perf_counter() - t0
    finally:
        view.release()
        memory.close()
        for fd in fds.values():
            os.close(fd)
    return {"rate": n / seconds, "seconds": seconds, "bytes": total, "threads": threads}


def back(nbytes: int) -> None:
    """Write ``nbytes`` of new memory, a byte a page, and free it: the allocations that follow
    at once reuse those pages, which the host backs until the guest reports them free again
    (a few seconds later where a balloon does)."""
    held = np.empty(max(1, nbytes), np.uint8)
    held[::4096] = 1
    del held


def _touch_us(nbytes: int) -> float:
    held = np.empty(nbytes, np.uint8)
    t0 = time.perf_counter()
    held[::4096] = 1
    seconds = time.perf_counter() - t0
    del held
    return seconds / (nbytes / 4096) * 1e6


def page_costs(nbytes: int = 256 * 2**20, idle_s: float = 4.0) -> dict[str, float]:
    """Microseconds to write a 4 KiB page for the first time: in memory freed ``idle_s`` before
    (time enough for a balloon to report it to the host, which takes it back) and in memory
    freed just before (still backed)."""
    back(nbytes)
    time.sleep(idle_s)
    idle = _touch_us(nbytes)
    return {"idle_us": idle, "recent_us": _touch_us(nbytes)}


def h5py_in_order(paths: list[str], n: int) -> dict[str, Any]:
    import h5py

    t0 = time.perf_counter()
    touched = 0.0
    first = None
    for p in paths:
        with h5py.File(p, "r") as f:
            d, lab = f["data"], f["label"]
            for i in range(0, d.shape[0], BATCH):
                x, y = d[i : i + BATCH], lab[i : i + BATCH]
                touched += float(x[:, 0].sum()) + float(y[0])
                if first is None:
                    first = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    return {"rate": n / seconds, "seconds": seconds, "first_batch_s": first}


def _filtered(paths: list[str]) -> tuple[Any, Any, Any] | None:
    """The catalog, the first file's layout of ``data`` and a decoder of its chunks; None where
    the layout is not stored filtered chunks."""
    from asynchdf5._codecs import ChunkDecoder

    _, catalog = _stored(paths)
    layout = catalog.files[0].layouts["data"]
    index = layout.chunks
    if layout.path != "chunks" or index is None or not layout.filters:
        return None
    itemsize = catalog.tops["data"].dtype.itemsize
    chunk_bytes = itemsize * int(np.prod(index.shape))
    return catalog, layout, ChunkDecoder(layout.filters, itemsize, chunk_bytes, index.shape)


def _held_chunks(paths: list[str], most_bytes: int) -> tuple[Any, int, list[Any]] | None:
    """What both decode limits decode: a decoder of ``data``'s stored chunks, its row's bytes,
    and those chunks read into memory (up to ``most_bytes`` of them: :func:`_raw_chunks`);
    None for an unfiltered layout."""
    filtered = _filtered(paths)
    if filtered is None:
        return None
    catalog, layout, decoder = filtered
    return decoder, catalog.tops["data"].row_bytes, _raw_chunks(layout.chunks, most_bytes)


def _decode_chunk(decoder: Any, raw: bytearray, mask: int, out: np.ndarray) -> None:
    """Decode one stored chunk into ``out`` (its bytes) as the reader does: straight in where
    it can (a chunk of whole rows), else as elements, the shuffle undone on the copy."""
    if not decoder.decode_into(raw, mask, out):
        from asynchdf5._codecs import copy_elements

        decoded = decoder.elements(raw, mask)
        copy_elements(out.reshape(decoded.shape), decoded)


def _limit(
    decoder: Any, row_bytes: int, chunks: int, seconds: float, threads: int, cpu: float
) -> dict[str, Any]:
    """A decode limit's figures: ``chunks`` chunks decoded in ``seconds`` on ``threads``
    threads, spending ``cpu`` CPU seconds."""
    samples = chunks * decoder.chunk_bytes / row_bytes
    return {
        "rate": samples / seconds,
        "seconds": seconds,
        "threads": threads,
        "chunks": chunks,
        "cpu_seconds": cpu,
    }


def decode(paths: list[str], n: int, most_bytes: int) -> dict[str, Any] | None:
    """The decode limit: stored chunks of ``data`` (up to ``most_bytes`` of them) decoded on
    every core, from memory, a task per chunk; None for an unfiltered layout."""
    held = _held_chunks(paths, most_bytes)
    if held is None:
        return None
    decoder, row_bytes, raws = held
    local = threading.local()

    def one(item: tuple[bytearray, int]) -> None:
        if not hasattr(local, "out"):  # as the reader's slot: memory of this thread's, reused
            local.out = np.empty(decoder.chunk_bytes, np.uint8)
        _decode_chunk(decoder, item[0], item[1], local.out)

    threads = os.cpu_count() or 1
    with ThreadPoolExecutor(threads) as pool:
        c0 = time.process_time()
        t0 = time.perf_counter()
        list(pool.map(one, raws))
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
    return _limit(decoder, row_bytes, len(raws), seconds, threads, cpu)


def decode_loop(paths: list[str], n: int, most_bytes: int) -> dict[str, Any] | None:
    """The tight decode limit: the chunks :func:`decode` decodes, by :func:`loop_decode`. Also
    the CPU seconds the threads spent (their own clocks), which says what a chunk's decode costs
    at least; None for an unfiltered layout."""
    held = _held_chunks(paths, most_bytes)
    if held is None:
        return None
    decoder, row_bytes, raws = held
    threads = os.cpu_count() or 1
    seconds, cpu = loop_decode([(decoder, raw, mask) for raw, mask in raws], threads)
    return _limit(decoder, row_bytes, len(raws), seconds, threads, cpu)


def loop_decode(chunks: Sequence[tuple[Any, bytearray, int]], threads: int) -> tuple[float, float]:
    """Stored chunks (their decoder, bytes and filter mask), already in memory, decoded by
    ``threads`` threads, each looping over its share (every ``threads``-th chunk) into a buffer
    of its own, reused; no task, lookup or allocation per chunk, and the same calls as the
    reader's (:func:`_decode_chunk`): the fastest decode of these chunks this machine does, the
    decode limit a layer is held to (the ``ragged`` benchmark's too).

    Returns
    -------
    tuple
        The wall seconds, and the CPU seconds the threads spent (their own clocks).
    """
    start = threading.Barrier(threads + 1)
    cpu = [0.0] * threads
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        outs: dict[int, np.ndarray] = {}  # a buffer per chunk size (one per decoder, mostly)
        mine = chunks[k::threads]
        start.wait()
        c0 = time.thread_time()
        try:
            for decoder, raw, mask in mine:
                out = outs.get(decoder.chunk_bytes)
                if out is None:
                    out = outs[decoder.chunk_bytes] = np.empty(decoder.chunk_bytes, np.uint8)
                _decode_chunk(decoder, raw, mask, out)
        except BaseException as exc:  # re-raised by the caller
            errors.append(exc)
        cpu[k] = time.thread_time() - c0

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds, sum(cpu)


def _raw_chunks(index: Any, most_bytes: int) -> list[tuple[bytearray, int]]:
    """The stored chunks of ``index`` in file order (up to ``most_bytes`` of them), each read
    into a bytearray of its own (writable, as the reader's buffers are: the decoders take their
    address without a copy), with its filter mask."""
    fd = os.open(index.file.name, os.O_RDONLY)
    raws: list[tuple[bytearray, int]] = []
    held = 0
    try:
        stored = zip(index.offsets.ravel(), index.sizes.ravel(), index.masks.ravel(), strict=True)
        for o, s, m in stored:
            if held >= most_bytes:
                break
            raws.append((bytearray(os.pread(fd, int(s), int(o))), int(m)))
            held += int(s)
    finally:
        os.close(fd)
    return raws


def decode_fresh(paths: list[str], n: int, most_bytes: int) -> dict[str, Any] | None:
    """As :func:`decode`, each chunk's rows placed at their rows of memory never written before
    (the reader's runs of chunks, :func:`asynchdf5._read._chunked.chunk_reads`, with ``fresh``);
    None for an unfiltered layout."""
    import mmap

    from asynchdf5._read._chunked import Need, chunk_reads

    filtered = _filtered(paths)
    if filtered is None:
        return None
    catalog, layout, decoder = filtered
    index, info = layout.chunks, catalog.tops["data"]
    rows_in_file = catalog.files[0].nrows
    share = min(1.0, most_bytes / max(1, int(index.sizes.sum())))
    rows = min(rows_in_file, max(index.rows, int(rows_in_file * share) // index.rows * index.rows))
    memory = mmap.mmap(-1, rows * info.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dest = np.frombuffer(memory, info.dtype).reshape(rows, *info.sample_shape)
    ranges = chunk_reads(layout, [Need(0, rows, dest)], decoder, "data", 2**30, fresh=True)
    fd = os.open(index.file.name, os.O_RDONLY)
    try:
        raws = [(r, os.pread(fd, r.size, r.offset)) for r in ranges]
    finally:
        os.close(fd)
    threads = os.cpu_count() or 1
    try:
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda item: item[0].then(item[1]), raws))
            seconds = time.perf_counter() - t0
    finally:
        del dest, ranges, raws  # every view of the memory, before it is unmapped
        memory.close()
    return {"rate": rows / seconds, "seconds": seconds, "threads": threads, "rows": rows}


def layer(source: str, n: int) -> dict[str, Any]:
    import anyio

    import asynchdf5

    out: dict[str, Any] = {}

    async def run() -> None:
        t0 = time.perf_counter()
        lay = asynchdf5.AsyncHDF5DataLayer(source, batch_size=BATCH, shuffle=True, seed=0)
        async with lay:
            epochs: list[float] = []
            for _ in range(2):
                t = time.perf_counter()
                seen, touched = 0, 0.0
                async for batch in lay:
                    if "first_batch_s" not in out:
                        out["first_batch_s"] = time.perf_counter() - t0
                    touched += float(batch["data"][:, 0].sum())
                    seen += len(batch.indices)
                if seen != n:
                    raise AssertionError(f"an epoch yielded {seen} samples of {n}")
                start = t0 if not epochs else t  # epoch 1 from construction: opening included
                epochs.append(n / (time.perf_counter() - start))
            out["epochs"] = epochs
            out["resident"] = lay.stats.resident
            out["read_paths"] = dict(lay.stats.read_paths)
            out["bottleneck"] = lay.stats.bottleneck()

    anyio.run(run)
    out["rate"] = out["epochs"][0]
    return out


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    import anyio  # noqa: F401  # imported before joining the cgroup
    import h5py  # noqa: F401

    import asynchdf5  # noqa: F401
    from benchmarks.page_cache import evict

    if job.get("cgroup_procs"):
        from benchmarks.cgroups import join

        join(job["cgroup_procs"])
    cold = bool(job["cold"])
    results: dict[str, Any] = {}
    pages = page_costs() if job["page_probe"] and not cold else None
    for name, lay in job["layouts"].items():
        paths, source, n = lay["paths"], lay["source"], lay["samples"]
        runs: dict[str, list[dict[str, Any]]] = {
            "raw": [], "raw_fresh": [], "raw_fresh_threads": [], "h5py": [], "layer": [],
            "layer_backed": [],
        }  # fmt: skip
        if not cold:
            raw(paths, n)  # warm: every stored byte in the page cache first
            found = decode(paths, n, job["decode_bytes"])
            if found is not None:
                runs["decode"] = [found]
                runs["decode_loop"] = [decode_loop(paths, n, job["decode_bytes"]) or {}]
            found = decode_fresh(paths, n, job["decode_bytes"])
            if found is not None:
                runs["decode_fresh"] = [found]
        for _ in range(job["rounds"]):
            # Into fresh memory only warm: under a memory limit the data set is streamed, never
            # held whole (nor could this reader hold it).
            readers = (
                ("raw", "h5py", "layer")
                if cold
                else ("raw", "raw_fresh", "raw_fresh_threads", "h5py", "layer", "layer_backed")
            )
            for reader in readers:
                if cold:
                    for p in paths:
                        evict(p)
                if reader == "raw":
                    runs[reader].append(raw(paths, n))
                elif reader == "raw_fresh":
                    runs[reader].append(raw_fresh(paths, n))
                elif reader == "raw_fresh_threads":
                    from asynchdf5._read import fill_threads

                    runs[reader].append(raw_fresh(paths, n, fill_threads()))
                elif reader == "h5py":
                    runs[reader].append(h5py_in_order(paths, n))
                elif reader == "layer_backed":
                    back(lay["decoded_bytes"] * 5 // 4)
                    runs[reader].append(layer(source, n))
                else:
                    runs[reader].append(layer(source, n))
        results[name] = runs
    with open(result_path, "w") as f:
        json.dump({"layouts": results, "load_end": os.getloadavg(), "pages": pages}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
