"""The in-RAM ceiling and the per-batch cost (``python -m benchmarks run ceilings``).

Two measurements: the Python cost of one batch through ``MemoryDataLayer`` against plain loops
(:func:`batch_cost`), and the images' in-RAM ceiling against hand-written loops and the layers
streaming the same file (:func:`ceiling`). The ratios are taken in one run, rounds alternated
so that a change of load hits both sides.
"""

from __future__ import annotations

import gc
import math
import mmap
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from benchmarks import sources
from benchmarks.data import DatasetFiles
from benchmarks.hand_loops import chunk_loop2_epochs, chunk_loop_epochs
from benchmarks.layer_runs import (
    BACKENDS,
    Array,
    EpochMeter,
    LayerRun,
    Sizes,
    async_epochs,
    image_layer_kwargs,
    image_set,
    layer_runs,
    load_arrays,
    median,
    rate,
    run_async,
    sizes,
    sync_deadline,
    sync_epochs,
)
from benchmarks.measure import describe
from benchmarks.report import Recorder


def _tiny_arrays(n: int, seed: int) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4), dtype=np.float32), "y": np.arange(n, dtype=np.int64)}


def _reference_epochs(
    arrays: dict[str, Array], b: int, epochs: int, how: str, shuffle: bool, seed: int
) -> LayerRun:
    """Plain loops: ``slice`` (views) or ``take`` (``np.take`` into reused buffers)."""
    x, y = arrays["x"], arrays["y"]
    n = len(x)
    rng = np.random.default_rng(seed)
    ox, oy = np.empty((b, *x.shape[1:]), x.dtype), np.empty(b, y.dtype)
    run = LayerRun()
    for _ in range(epochs):
        meter = EpochMeter(run)
        if how == "slice":
            for i in range(0, n, b):
                _xb, yb = x[i : i + b], y[i : i + b]
                meter.batch(len(yb))
        else:
            order = rng.permutation(n) if shuffle else np.arange(n)
            for i in range(0, n, b):
                idx = order[i : i + b]
                k = len(idx)
                np.take(x, idx, axis=0, out=ox[:k], mode="clip")
                np.take(y, idx, axis=0, out=oy[:k], mode="clip")
                meter.batch(k)
        meter.end(n)
    return run


def batch_cost(rec: Recorder, cfg: Sizes) -> None:
    """Per-batch Python cost: ``MemoryDataLayer`` over tiny arrays, batch 32, a consumer that
    does nothing, with ``async for`` (asyncio, trio) and the sync facade, against plain loops
    over the same arrays (``slice`` views; ``np.take`` into reused buffers)."""
    import asynchdf5

    n, b, epochs = cfg.tiny_samples, cfg.tiny_batch, cfg.tiny_epochs
    arrays = _tiny_arrays(n, cfg.seed)
    nb = math.ceil(n / b)
    for shuffle in (False, True):
        refs = {
            how: _reference_epochs(arrays, b, epochs, how, shuffle, cfg.seed)
            for how in ("slice", "take")
        }
        ref_us = {how: median(r.epoch_s) / nb * 1e6 for how, r in refs.items()}

        def make(shuffle: bool = shuffle) -> Any:
            return asynchdf5.MemoryDataLayer(
                data=arrays, batch_size=b, shuffle=shuffle, seed=cfg.seed
            )

        runs: list[tuple[str, LayerRun | str]] = []
        for backend in BACKENDS:
            label = f"`async for`, {backend}"
            try:
                runs.append(
                    (
                        label,
                        run_async(partial(async_epochs, make, epochs, n), cfg.deadline_s, backend),
                    )
                )
            except Exception as exc:
                runs.append((label, describe(exc)))
        label = "sync `with`/`for` (asyncio)"
        try:
            runs.append((label, sync_epochs(make, epochs, n, cfg.deadline_s)))
        except Exception as exc:
            runs.append((label, describe(exc)))
        runs += [(f"reference: plain loop, {how}", r) for how, r in refs.items()]
        for label, run in runs:
            what = f"{label}, {'shuffled' if shuffle else 'in order'}"
            if isinstance(run, str):
                rec.note(f"{what}: failed: {run}")
                continue
            per = median(run.epoch_s) / nb * 1e6
            rec.figure(f"{what}: wall per batch (median epoch)", per, "µs")
            rec.figure(
                f"{what}: consumer-thread CPU per batch", median(run.thread_cpu_s) / nb * 1e6, "µs"
            )
            rec.figure(f"{what}: process CPU per batch", median(run.process_cpu_s) / nb * 1e6, "µs")
            rec.ratio(f"{what}: ÷ plain take loop", per, ref_us["take"])
        gc.collect()


def _ceiling_1(data: Array, label: Array, b: int, rng: np.random.Generator) -> float:
    """One epoch: a permutation, then ``np.take`` per batch into reused buffers; seconds."""
    n = len(data)
    od, ol = np.empty((b, *data.shape[1:]), data.dtype), np.empty(b, label.dtype)
    t0 = time.perf_counter()
    perm = rng.permutation(n)
    for start in range(0, n, b):
        idx = perm[start : start + b]
        k = len(idx)
        np.take(data, idx, axis=0, out=od[:k], mode="clip")
        np.take(label, idx, axis=0, out=ol[:k], mode="clip")
    return time.perf_counter() - t0


def _ceiling_2(
    data: Array,
    label: Array,
    b: int,
    rng: np.random.Generator,
    pool: ThreadPoolExecutor,
    depth: int = 4,
) -> float:
    """The same with the pool's 2 threads gathering alternate batches into ``depth`` rotating
    buffers; the consumer takes batches in order and frees a buffer by taking its batch."""
    n = len(data)
    nb = math.ceil(n / b)
    bufs = [
        (np.empty((b, *data.shape[1:]), data.dtype), np.empty(b, label.dtype)) for _ in range(depth)
    ]
    t0 = time.perf_counter()
    perm = rng.permutation(n)

    def gather(k: int) -> int:
        idx = perm[k * b : (k + 1) * b]
        od, ol = bufs[k % depth]
        np.take(data, idx, axis=0, out=od[: len(idx)], mode="clip")
        np.take(label, idx, axis=0, out=ol[: len(idx)], mode="clip")
        return len(idx)

    pending: deque[Future[int]] = deque(pool.submit(gather, k) for k in range(min(depth, nb)))
    nxt = len(pending)
    samples = 0
    while pending:
        samples += pending.popleft().result()  # batch k in hand; its buffer is free after
        if nxt < nb:
            pending.append(pool.submit(gather, nxt))
            nxt += 1
    elapsed = time.perf_counter() - t0
    assert samples == n
    return elapsed


def _small_pages(a: Array) -> Array | None:
    """A copy of ``a`` on 4 KiB pages (``MADV_NOHUGEPAGE``), the page size under a mapped file's
    page cache here; NumPy's own large arrays get transparent huge pages (None: not Linux)."""
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return None
    m = mmap.mmap(-1, max(1, a.nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    out: Array = np.frombuffer(m, a.dtype, a.size).reshape(a.shape)
    out[...] = a
    return out


def _copy_rate(threads: int, nbytes: int = 512 * 2**20) -> float:
    """Bytes copied per second by ``np.copyto`` between two warm buffers, split over
    ``threads`` (best of 5): the memory bandwidth every loader here shares."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    parts = [(i * nbytes // threads, (i + 1) * nbytes // threads) for i in range(threads)]

    def copy(part: tuple[int, int]) -> None:
        np.copyto(dst[part[0] : part[1]], src[part[0] : part[1]])

    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(copy, parts))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def ceiling(rec: Recorder, cfg: Sizes, files: DatasetFiles) -> None:
    """The in-RAM ceiling (one permutation per epoch, ``np.take`` into reused buffers; 1 thread,
    2 threads gathering alternate batches, and 1 thread on 4 KiB pages, the page size of a mapped
    file's page cache) against hand-written chunk loops (1 thread; 2 threads, reading the next
    chunk meanwhile; mapped) and the layers streaming the same file through a two-slot cache
    (warm page cache). Rates: median of later epochs and of first epochs (from construction)."""
    import asynchdf5

    n, b = files.spec.samples, cfg.image_batch
    t_load = time.perf_counter()
    data, label = load_arrays(files)
    load_s = time.perf_counter() - t_load
    small = _small_pages(data), _small_pages(label)
    rng = np.random.default_rng(cfg.seed)
    c1: list[float] = []
    c2: list[float] = []
    c4k: list[float] = []
    hdf5_runs: list[LayerRun] = []
    mem_runs: list[LayerRun] = []
    loop_runs: list[LayerRun] = []
    loop2_runs: list[LayerRun] = []
    mapped_runs: list[LayerRun] = []
    copy_runs: list[LayerRun] = []
    errors: list[str] = []
    kwargs = image_layer_kwargs(files, cfg)
    copy1, copy2 = _copy_rate(1, cfg.copy_bytes), _copy_rate(2, cfg.copy_bytes)
    with ThreadPoolExecutor(2, thread_name_prefix="ceiling") as pool:
        for _ in range(cfg.rounds):
            with sync_deadline(cfg.deadline_s):
                c1 += [_ceiling_1(data, label, b, rng) for _ in range(cfg.ceiling_epochs)]
                c2 += [_ceiling_2(data, label, b, rng, pool) for _ in range(cfg.ceiling_epochs)]
                if small[0] is not None and small[1] is not None:
                    c4k += [
                        _ceiling_1(small[0], small[1], b, rng) for _ in range(cfg.ceiling_epochs)
                    ]
            sources.warm(files)
            with sync_deadline(cfg.deadline_s):
                loop_runs.append(
                    chunk_loop_epochs(files, b, cfg.image_chunk, cfg.seed, cfg.layer_epochs)
                )
            for what, loop, runs in (
                ("2-thread chunk loop", chunk_loop2_epochs, loop2_runs),
                ("mapped loop", partial(chunk_loop_epochs, mapped=True), mapped_runs),
            ):
                try:  # contiguous data sets only
                    with sync_deadline(cfg.deadline_s):
                        runs.append(loop(files, b, cfg.image_chunk, cfg.seed, cfg.layer_epochs))
                except ValueError as exc:
                    errors.append(f"{what}: {exc}")
            layer_runs(
                hdf5_runs,
                errors,
                "AsyncHDF5DataLayer",
                partial(asynchdf5.AsyncHDF5DataLayer, **kwargs),
                cfg.layer_epochs,
                n,
                cfg.deadline_s,
            )
            layer_runs(
                copy_runs,
                errors,
                "AsyncHDF5DataLayer(mmap=False)",
                partial(asynchdf5.AsyncHDF5DataLayer, **kwargs, mmap=False),
                cfg.layer_epochs,
                n,
                cfg.deadline_s,
            )
            layer_runs(
                mem_runs,
                errors,
                "MemoryDataLayer",
                partial(
                    asynchdf5.MemoryDataLayer,
                    data={"data": data, "label": label},
                    batch_size=b,
                    shuffle=True,
                    seed=cfg.seed,
                ),
                cfg.layer_epochs,
                n,
                cfg.deadline_s,
            )
    rec.figure("in-RAM ceiling, 1 thread (np.take)", rate(n, median(c1)), "samples/s")
    rec.figure("in-RAM ceiling, 2 threads (alternate batches)", rate(n, median(c2)), "samples/s")
    if c4k:
        rec.figure(
            "in-RAM ceiling, 1 thread, arrays on 4 KiB pages", rate(n, median(c4k)), "samples/s"
        )
    rec.figure("loading the arrays into RAM", load_s, "s")
    r1 = rate(n, median(c1))
    rl2 = rate(n, median([s for r in loop2_runs for s in r.later_s])) if loop2_runs else None
    for label_, runs in (
        ("chunk loop, 1 thread (read_direct + np.take)", loop_runs),
        ("chunk loop, 2 threads (preadv of the next chunk meanwhile)", loop2_runs),
        ("mapped loop, 1 thread (np.memmap, no copy; not safe)", mapped_runs),
        ('AsyncHDF5DataLayer, default (mmap="auto")', hdf5_runs),
        ("AsyncHDF5DataLayer(mmap=False)", copy_runs),
        ("MemoryDataLayer over the in-RAM arrays", mem_runs),
    ):
        if not runs:
            rec.note(f"{label_}: failed")
            continue
        later = rate(n, median([s for r in runs for s in r.later_s]))
        rec.figure(f"{label_}, later epochs", later, "samples/s")
        rec.figure(
            f"{label_}, first epoch", rate(n, median([r.epoch_s[0] for r in runs])), "samples/s"
        )
        rec.ratio(f"{label_}, later epochs ÷ 1-thread ceiling", later, r1)
        rec.ratio(f"{label_}, later epochs ÷ 2-thread chunk loop", later, rl2)
        if runs[-1].stats is not None:
            rec.note(f"{label_}: {runs[-1].note()}")
    rec.figure("memory copy (np.copyto), 1 thread", copy1 / 1e9, "GB/s")
    rec.figure("memory copy (np.copyto), 2 threads", copy2 / 1e9, "GB/s")
    for e in errors:
        rec.note(e)


def bench(rec: Recorder) -> None:
    """Both measurements, on the suite's image set at this run's size."""
    cfg = sizes(rec)
    rec.param(
        tiny_samples=cfg.tiny_samples, tiny_batch=cfg.tiny_batch, image_samples=cfg.image_samples,
        image_batch=cfg.image_batch, image_chunk=cfg.image_chunk, rounds=cfg.rounds,
    )  # fmt: skip
    batch_cost(rec, cfg)
    ceiling(rec, cfg, image_set(cfg))
