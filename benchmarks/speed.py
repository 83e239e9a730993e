"""Issue 12's speed measurements, as ratios taken in one run: ``python -m benchmarks.speed``.

1. **Per-batch cost** (``batch``): ``MemoryDataLayer`` over tiny arrays (float32 ``(N, 4)`` and
   int64 ``(N,)``), batch 32, a consumer that does nothing, with ``async for`` on asyncio and on
   trio and with the sync facade (``with`` / ``for``); against plain Python loops over the same
   arrays (slice views; ``np.take`` into reused buffers). Wall µs per batch (median of epochs),
   the consumer thread's CPU time per batch (``time.thread_time``) and the process's.
2. **In-RAM ceiling** (``ceiling``): 3x32x32 uint8 images + int64 labels in RAM, one permutation
   per epoch, ``np.take`` into reused batch buffers, with 1 thread and with a 2-thread pool that
   gathers alternate batches (the consumer takes them in order). Beside it
   ``AsyncHDF5DataLayer`` streaming the same samples from an HDF5 file (warm page cache) through a
   cache smaller than the data set, and ``MemoryDataLayer`` over the in-RAM arrays.
3. **Tabular** (``tabular``): float32[64] + int64 rows in one contiguous HDF5 file: asynchdf5
   streaming with chunk size C against a hand-written single-thread chunk loop at the same C
   (``read_direct`` a chunk, permute, ``np.take`` per batch), epoch 1 and later epochs.
4. **Event-loop gaps** (``probe``): a task that sleeps 1 ms in a loop records the gaps between its
   wake-ups while ``async for`` streams the image file and the consumer does nothing, awaits a
   simulated GPU step (``anyio.sleep``) or does ~1 ms of GIL-holding CPU work per batch, each
   with the pipeline's threads at the process's priority and 10 nice steps below it
   (``ASYNCHDF5_NICE``), alternating; three epochs per opening, the first (opening and ramp
   included) reported apart from the later ones (the steady state); then, beside one busy
   process per core, at 0, 3 and 10.
5. **First batch and sync facade** (``first``): from construction to the first batch in hand for
   three chunk sizes, and ``HDF5DataLayer`` (``with`` / ``for``) against ``AsyncHDF5DataLayer`` on
   the image file.

Every async measurement runs under ``anyio.fail_after``; every sync one under a ``SIGALRM``
deadline; and every measurement under a hard ``faulthandler`` stop, so nothing can hang. Data sets
are generated with :mod:`benchmarks.data` into ``--data-dir`` and reused while their parameters
hold (the image and tabular files are the ones the suite would generate at these sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import faulthandler
import gc
import math
import mmap
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar

import anyio
import h5py
import numpy as np
import numpy.typing as npt
import psutil

from benchmarks import sources
from benchmarks.config import DEFAULT_DATA_DIR, DatasetSpec, SuiteConfig
from benchmarks.data import DatasetFiles, ensure
from benchmarks.measure import _describe
from benchmarks.probes import IDLE_S, TICK_S, _gap_stats
from benchmarks.report import _git_head
from benchmarks.sources import H5Rows

SECTIONS = ("batch", "ceiling", "tabular", "probe", "first")
Backend = Literal["asyncio", "trio"]
BACKENDS: tuple[Backend, ...] = ("asyncio", "trio")
#: Seconds past a measurement's own deadline after which the process is stopped outright.
HARD_GRACE_S = 30.0

T = TypeVar("T")
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class SpeedConfig:
    """Sizes of one run (the defaults take a few minutes on a 2-vCPU machine).

    Attributes
    ----------
    tiny_samples, tiny_batch, tiny_epochs
        Section 1: rows of the tiny arrays, batch size, epochs per configuration.
    image_samples, image_batch, image_chunk
        Sections 2, 4, 5: images in the file and in RAM, batch size, the streaming chunk size
        (the cache is two slots of it: smaller than the data set).
    ceiling_epochs, layer_epochs, rounds
        Epochs per ceiling measurement and per layer opening; rounds of (ceilings, layers),
        alternated so that a change of load hits both sides of a ratio.
    tabular_rows, tabular_chunk
        Section 3: rows of the tabular file and the chunk size of both loaders.
    step_s
        Section 4: the simulated training step (sleep or GIL-holding CPU work) per batch.
    probe_batches, probe_epochs
        Section 4: batches per probe epoch (0: a whole epoch), and epochs per opening: the
        first epoch's gaps (opening the files, the ramp) and the later epochs' (the steady
        state) are reported apart.
    first_chunks, first_repeats
        Section 5: chunk sizes for the first-batch latency, and openings per chunk size.
    deadline_s
        Limit of one measurement (an opening and its epochs).
    """

    tiny_samples: int = 320_000
    tiny_batch: int = 32
    tiny_epochs: int = 5
    image_samples: int = 350_000
    image_batch: int = 256
    image_chunk: int = 2**16
    ceiling_epochs: int = 3
    layer_epochs: int = 3
    rounds: int = 2
    tabular_rows: int = 4_000_000
    tabular_chunk: int = 2**18
    step_s: float = 0.001
    probe_batches: int = 0
    probe_epochs: int = 3
    first_chunks: tuple[int, ...] = (2**14, 2**17, 2**20)
    first_repeats: int = 3
    deadline_s: float = 120.0
    seed: int = 0
    data_dir: Path = DEFAULT_DATA_DIR
    only: tuple[str, ...] = ()
    gc_freeze: bool = False


QUICK: dict[str, Any] = {
    "tiny_samples": 32_000,
    "image_samples": 20_000,
    "image_chunk": 2**12,
    "ceiling_epochs": 2,
    "rounds": 1,
    "tabular_rows": 80_000,
    "tabular_chunk": 2**13,
    "probe_batches": 40,
    "first_repeats": 2,
    "deadline_s": 30.0,
}


# --------------------------------------------------------------------------------------------
# Deadlines and small helpers


@contextlib.contextmanager
def _hard_stop(seconds: float) -> Iterator[None]:
    """Stop the process (with every thread's traceback) if the block overruns by far."""
    faulthandler.dump_traceback_later(seconds + HARD_GRACE_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def _sync_deadline(seconds: float) -> Iterator[None]:
    """``TimeoutError`` in the main thread after ``seconds`` (a real signal, so that it also
    interrupts a wait on a lock), and the hard stop behind it."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"sync measurement overran its {seconds:g} s deadline")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with _hard_stop(seconds):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _run_async(fn: Callable[[], Awaitable[T]], seconds: float, backend: Backend = "asyncio") -> T:
    """``fn()`` on a fresh event loop, under ``anyio.fail_after(seconds)`` and the hard stop."""

    async def bounded() -> T:
        try:
            with anyio.fail_after(seconds):
                return await fn()
        except TimeoutError as exc:
            raise TimeoutError(f"async measurement overran its {seconds:g} s deadline") from exc

    with _hard_stop(seconds):
        return anyio.run(bounded, backend=backend)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not math.isnan(a) and not math.isnan(b) else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _rate(samples: int, seconds: float) -> float:
    return samples / seconds if seconds > 0 else math.nan


def _fmt_rate(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}"


def _log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def _suite_set(name: str, image_samples: int, tabular_rows: int) -> DatasetSpec:
    """The suite's data set ``name`` at these sizes: the same definition, the same bytes."""
    sets = SuiteConfig(image_samples=image_samples, tabular_rows=tabular_rows).datasets()
    return next(spec for spec in sets if spec.name == name)


def _load(files: DatasetFiles) -> tuple[Array, Array]:
    """Both tops of a data set, read whole into RAM."""
    out = []
    for top in ("data", "label"):
        with H5Rows(files, top) as rows:
            arr = rows.empty(len(rows))
            rows.read_direct(0, len(rows), arr)
            out.append(arr)
    return out[0], out[1]


# --------------------------------------------------------------------------------------------
# Epochs of a layer


@dataclass
class LayerRun:
    """Epochs of one layer opening.

    ``epoch_s[0]`` runs from construction to the end of the first epoch; later ones from their
    ``for`` to their end. ``thread_cpu_s`` / ``process_cpu_s`` are per epoch, like ``epoch_s``.
    """

    epoch_s: list[float] = field(default_factory=list)
    thread_cpu_s: list[float] = field(default_factory=list)
    process_cpu_s: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    first_batch_s: float | None = None
    close_s: float = 0.0
    stats: Any = None

    @property
    def later_s(self) -> list[float]:
        return self.epoch_s[1:]

    def note(self) -> str:
        s = self.stats
        if s is None:
            return ""
        paths = ", ".join(f"{k}: {v}" for k, v in s.read_paths.items()) or "in place"
        return (
            f"chunk_rows {s.chunk_rows:,}, resident {s.resident}, read {paths}; "
            f"bottleneck: {s.bottleneck()}"
        )


class _EpochMeter:
    def __init__(self, run: LayerRun, t0: float | None = None) -> None:
        self.run = run
        self.t0 = time.perf_counter() if t0 is None else t0
        self.c0, self.p0 = time.thread_time(), time.process_time()
        self.batches = 0
        self.samples = 0

    def batch(self, rows: int) -> None:
        if self.batches == 0 and self.run.first_batch_s is None:
            self.run.first_batch_s = time.perf_counter() - self.t0
        self.batches += 1
        self.samples += rows

    def end(self, expected: int) -> None:
        r = self.run
        r.epoch_s.append(time.perf_counter() - self.t0)
        r.thread_cpu_s.append(time.thread_time() - self.c0)
        r.process_cpu_s.append(time.process_time() - self.p0)
        r.batches.append(self.batches)
        if self.samples != expected:
            raise AssertionError(f"an epoch yielded {self.samples} samples, not {expected}")


def _layer_runs(
    runs: list[LayerRun],
    errors: list[str],
    what: str,
    make: Callable[[], Any],
    epochs: int,
    n: int,
    deadline_s: float,
) -> None:
    """One opening of ``epochs`` epochs of ``make()`` appended to ``runs``; a failure is noted in
    ``errors`` as ``what: ...`` instead."""
    try:
        runs.append(_run_async(partial(_async_epochs, make, epochs, n), deadline_s))
    except Exception as exc:
        errors.append(f"{what}: {_describe(exc)}")


async def _async_epochs(make: Callable[[], Any], epochs: int, n: int) -> LayerRun:
    """``epochs`` epochs of ``async for`` over ``make()``, the clock started before ``make``."""
    run = LayerRun()
    t0 = time.perf_counter()
    layer = make()
    async with layer:
        for e in range(epochs):
            meter = _EpochMeter(run, t0 if e == 0 else None)
            async for batch in layer:
                meter.batch(batch.size)
            meter.end(n)
        run.stats = layer.stats
        t_close = time.perf_counter()
    run.close_s = time.perf_counter() - t_close
    return run


def _sync_epochs(make: Callable[[], Any], epochs: int, n: int, deadline_s: float) -> LayerRun:
    """The same with ``with`` / ``for`` (the sync facade), under a deadline."""
    run = LayerRun()
    with _sync_deadline(deadline_s):
        t0 = time.perf_counter()
        layer = make()
        with layer:
            for e in range(epochs):
                meter = _EpochMeter(run, t0 if e == 0 else None)
                for batch in layer:
                    meter.batch(batch.size)
                meter.end(n)
            run.stats = layer.stats
            t_close = time.perf_counter()
        run.close_s = time.perf_counter() - t_close
    return run


# --------------------------------------------------------------------------------------------
# 1. Per-batch Python cost


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
        meter = _EpochMeter(run)
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


def section_batch(cfg: SpeedConfig) -> list[str]:
    import asynchdf5

    n, b, epochs = cfg.tiny_samples, cfg.tiny_batch, cfg.tiny_epochs
    arrays = _tiny_arrays(n, cfg.seed)
    nb = math.ceil(n / b)
    rows: list[Sequence[object]] = []
    notes: list[str] = []
    for shuffle in (False, True):
        refs = {
            how: _reference_epochs(arrays, b, epochs, how, shuffle, cfg.seed)
            for how in ("slice", "take")
        }
        ref_us = {how: _median(r.epoch_s) / nb * 1e6 for how, r in refs.items()}

        def make(backend: Backend = "asyncio", shuffle: bool = shuffle) -> Any:
            return asynchdf5.MemoryDataLayer(
                data=arrays, batch_size=b, shuffle=shuffle, seed=cfg.seed, backend=backend
            )

        runs: list[tuple[str, LayerRun | str]] = []
        for backend in BACKENDS:
            label = f"`async for`, {backend}"
            try:
                runs.append(
                    (
                        label,
                        _run_async(
                            partial(_async_epochs, make, epochs, n), cfg.deadline_s, backend
                        ),
                    )
                )
            except Exception as exc:
                runs.append((label, _describe(exc)))
        for backend in BACKENDS:
            label = f"sync `with`/`for`, backend={backend}"
            try:
                runs.append(
                    (
                        label,
                        _sync_epochs(partial(make, backend), epochs, n, cfg.deadline_s),
                    )
                )
            except Exception as exc:
                runs.append((label, _describe(exc)))
        runs += [(f"reference: plain loop, {how}", r) for how, r in refs.items()]
        for label, run in runs:
            if isinstance(run, str):
                rows.append([label, shuffle, f"failed: {run}", "", "", "", "", ""])
                continue
            per = _median(run.epoch_s) / nb * 1e6
            rows.append(
                [
                    label,
                    shuffle,
                    f"{per:.1f}",
                    f"{min(run.epoch_s) / nb * 1e6:.1f}",
                    f"{_median(run.thread_cpu_s) / nb * 1e6:.1f}",
                    f"{_median(run.process_cpu_s) / nb * 1e6:.1f}",
                    _ratio(per, ref_us["slice"]),
                    _ratio(per, ref_us["take"]),
                ]
            )
            if run.stats is not None and not notes:
                notes.append(f"MemoryDataLayer: {run.note()}")
        gc.collect()
    lines = [
        "## 1. Per-batch Python cost",
        "",
        f"`MemoryDataLayer` over `x` float32 ({n:,}, 4) and `y` int64 ({n:,},), batch {b} "
        f"({nb:,} batches per epoch), a consumer that does nothing, {epochs} epochs per row "
        "(one opening). µs per batch: wall (median and best epoch), CPU of the consumer's "
        "thread (`time.thread_time`: for `async for` the event loop's thread, which also runs "
        "the pipeline's tasks; for `for` the loop's thread, not the bridge's event loop) and of "
        "the whole process. The references are plain loops over the same arrays: `slice` "
        "takes views `x[i:i+32]`; `take` gathers into reused buffers with `np.take` (in a "
        "permuted order when shuffled).",
        "",
        *_table(
            [
                "loop",
                "shuffle",
                "wall µs/batch (median)",
                "best",
                "consumer-thread CPU µs/batch",
                "process CPU µs/batch",
                "÷ slice loop",
                "÷ take loop",
            ],
            rows,
        ),
    ]
    return lines + (["", *notes] if notes else [])


# --------------------------------------------------------------------------------------------
# 2. In-RAM ceiling, 1 and 2 threads, against the layers


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


def _image_layer_kwargs(files: DatasetFiles, cfg: SpeedConfig) -> dict[str, Any]:
    """The streaming configuration: chunks of ``image_chunk`` in a cache of exactly two slots,
    smaller than the data set, so every epoch reads the whole file again."""
    return {
        "source": str(files.source),
        "batch_size": cfg.image_batch,
        "tops": ("data", "label"),
        "shuffle": True,
        "seed": cfg.seed,
        "chunk_size": cfg.image_chunk,
        "cache_bytes": 2 * cfg.image_chunk * files.spec.sample_bytes,
    }


def section_ceiling(cfg: SpeedConfig, files: DatasetFiles) -> list[str]:
    import asynchdf5

    n, b = files.spec.samples, cfg.image_batch
    t_load = time.perf_counter()
    data, label = _load(files)
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
    kwargs = _image_layer_kwargs(files, cfg)
    copy1, copy2 = _copy_rate(1), _copy_rate(2)
    with ThreadPoolExecutor(2, thread_name_prefix="ceiling") as pool:
        for _ in range(cfg.rounds):
            with _sync_deadline(cfg.deadline_s):
                c1 += [_ceiling_1(data, label, b, rng) for _ in range(cfg.ceiling_epochs)]
                c2 += [_ceiling_2(data, label, b, rng, pool) for _ in range(cfg.ceiling_epochs)]
                if small[0] is not None and small[1] is not None:
                    c4k += [
                        _ceiling_1(small[0], small[1], b, rng) for _ in range(cfg.ceiling_epochs)
                    ]
            sources.warm(files)
            with _sync_deadline(cfg.deadline_s):
                loop_runs.append(
                    _chunk_loop_epochs(files, b, cfg.image_chunk, cfg.seed, cfg.layer_epochs)
                )
            for what, loop, runs in (
                ("2-thread chunk loop", _chunk_loop2_epochs, loop2_runs),
                ("mapped loop", partial(_chunk_loop_epochs, mapped=True), mapped_runs),
            ):
                try:  # contiguous data sets only
                    with _sync_deadline(cfg.deadline_s):
                        runs.append(loop(files, b, cfg.image_chunk, cfg.seed, cfg.layer_epochs))
                except ValueError as exc:
                    errors.append(f"{what}: {exc}")
            _layer_runs(
                hdf5_runs,
                errors,
                "AsyncHDF5DataLayer",
                partial(asynchdf5.AsyncHDF5DataLayer, **kwargs),
                cfg.layer_epochs,
                n,
                cfg.deadline_s,
            )
            _layer_runs(
                copy_runs,
                errors,
                "AsyncHDF5DataLayer(mmap=False)",
                partial(asynchdf5.AsyncHDF5DataLayer, **kwargs, mmap=False),
                cfg.layer_epochs,
                n,
                cfg.deadline_s,
            )
            _layer_runs(
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
    r1, r2 = _rate(n, _median(c1)), _rate(n, _median(c2))
    rl = _rate(n, _median([s for r in loop_runs for s in r.later_s])) if loop_runs else math.nan
    rl2 = _rate(n, _median([s for r in loop2_runs for s in r.later_s])) if loop2_runs else math.nan
    rows: list[Sequence[object]] = [
        [
            "in-RAM ceiling, 1 thread (`np.take`)",
            _fmt_rate(r1),
            "",
            "1.00",
            _ratio(r1, r2),
            _ratio(r1, rl),
            _ratio(r1, rl2),
        ],
        [
            "in-RAM ceiling, 2 threads (alternate batches)",
            _fmt_rate(r2),
            "",
            _ratio(r2, r1),
            "1.00",
            _ratio(r2, rl),
            _ratio(r2, rl2),
        ],
    ]
    if c4k:
        r4 = _rate(n, _median(c4k))
        rows.append(
            [
                "in-RAM ceiling, 1 thread, the arrays on 4 KiB pages (`MADV_NOHUGEPAGE`): the "
                "page size of a mapped file's page cache here",
                _fmt_rate(r4),
                "",
                _ratio(r4, r1),
                _ratio(r4, r2),
                _ratio(r4, rl),
                _ratio(r4, rl2),
            ]
        )
    notes = [
        f"Loading the arrays into RAM took {load_s:.1f} s; ceiling epochs, s: 1 thread "
        + ", ".join(f"{x:.3f}" for x in c1)
        + "; 2 threads "
        + ", ".join(f"{x:.3f}" for x in c2)
        + ("; 1 thread on 4 KiB pages " + ", ".join(f"{x:.3f}" for x in c4k) if c4k else "")
        + "."
    ]
    for label_, runs in (
        (
            f"hand-written chunk loop, 1 thread: `read_direct` {cfg.image_chunk:,} rows (warm "
            "page cache) + `np.take`",
            loop_runs,
        ),
        (
            f"hand-written chunk loop, 2 threads: `os.preadv` of the next {cfg.image_chunk:,} "
            "rows on a second thread while this chunk is gathered",
            loop2_runs,
        ),
        (
            f"hand-written mapped loop, 1 thread: chunks of {cfg.image_chunk:,} rows gathered "
            "straight from `np.memmap` (no copy out of the page cache; not safe against a file "
            "truncated meanwhile)",
            mapped_runs,
        ),
        (
            'asynchdf5 `AsyncHDF5DataLayer`, default properties (`mmap="auto"`: the file '
            "mapped where that is safe; `read_paths` below), streaming, warm page cache",
            hdf5_runs,
        ),
        (
            "asynchdf5 `AsyncHDF5DataLayer(mmap=False)`, the same chunks copied into the cache "
            "(warm page cache)",
            copy_runs,
        ),
        ("asynchdf5 `MemoryDataLayer` over the in-RAM arrays", mem_runs),
    ):
        if not runs:
            rows.append([label_, "failed", "", "", "", "", ""])
            continue
        later = _rate(n, _median([s for r in runs for s in r.later_s]))
        first = _rate(n, _median([r.epoch_s[0] for r in runs]))
        rows.append(
            [
                label_,
                _fmt_rate(later),
                _fmt_rate(first),
                _ratio(later, r1),
                _ratio(later, r2),
                _ratio(later, rl),
                _ratio(later, rl2),
            ]
        )
        notes.append(
            f"{label_}: epochs, s: "
            + "; ".join(", ".join(f"{x:.3f}" for x in r.epoch_s) for r in runs)
            + f". {runs[-1].note()}"
        )
    copy_s = files.spec.total_bytes / copy1
    notes.append(
        f"Memory copy rate (`np.copyto`, 512 MiB, bytes copied per second): 1 thread "
        f"{copy1 / 1e9:.1f} GB/s, 2 threads {copy2 / 1e9:.1f} GB/s. An epoch that streams "
        "copies every byte once more than the in-RAM ceiling does (page cache into the cache "
        f"slot, then the gather): at 1 thread's rate that copy alone is {copy_s:.3f} s per "
        "epoch, the ceiling's own gather another copy of the same size."
    )
    notes += errors
    cache = kwargs["cache_bytes"]
    return [
        "## 2. In-RAM ceiling with 1 and 2 threads, against asynchdf5",
        "",
        f"{files.spec.title} ({files.spec.total_bytes / 2**30:.2f} GiB), batch {b}, shuffled. "
        "The ceilings draw one permutation per epoch and `np.take` every top into reused "
        "batch buffers (2 threads: a `ThreadPoolExecutor(2)` gathers alternate batches into 4 "
        "rotating buffer pairs, the consumer takes them in order). The chunk loop is the "
        "hand-written streaming loader of section 3 at this chunk size (each chunk of whole "
        "contiguous rows read into one reused buffer, then gathered): the same bytes moved "
        "as by a streaming layer, on one thread; the 2-thread chunk loop reads the next chunk "
        "on a second thread (`os.preadv`, GIL released) while the main thread gathers this one: "
        "the pipelining a skilled user would write by hand. `AsyncHDF5DataLayer`: "
        f"`chunk_size={cfg.image_chunk:,}`, `cache_bytes={cache:,}` (two slots, "
        f"{cache / files.spec.total_bytes:.0%} of the data set: every epoch streams the file), "
        "read with the page cache warm. Rates: median of later epochs (2nd on) and of first "
        f"epochs (from construction), {cfg.rounds} round(s) of "
        f"{cfg.ceiling_epochs} ceiling epochs each + one opening of {cfg.layer_epochs} epochs "
        "per layer.",
        "",
        *_table(
            [
                "loader",
                "samples/s (later epochs)",
                "first epoch",
                "÷ 1-thread ceiling",
                "÷ 2-thread ceiling",
                "÷ chunk loop",
                "÷ 2-thread chunk loop",
            ],
            rows,
        ),
        "",
        *notes,
    ]


# --------------------------------------------------------------------------------------------
# 3. Tabular: asynchdf5 streaming against the single-thread chunk loop


def _serve_chunk(
    slot: Sequence[Array], outs: Sequence[Array], perm: Array, b: int, meter: _EpochMeter
) -> None:
    """The batches of one chunk in ``slot`` (a top each), in the order ``perm``: ``np.take``
    into the reused buffers ``outs``."""
    for start in range(0, len(perm), b):
        idx = perm[start : start + b]
        for src, out in zip(slot, outs, strict=True):
            np.take(src, idx, axis=0, out=out[: len(idx)], mode="clip")
        meter.batch(len(idx))


def _chunk_loop_epochs(
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
            maps = _mappings(files, tops)

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
            meter = _EpochMeter(run, t0 if e == 0 else None)
            for c in rng.permutation(range(0, n, cs)):
                stop = min(int(c) + cs, n)
                _serve_chunk(chunk(int(c), stop), outs, rng.permutation(stop - int(c)), b, meter)
            meter.end(n)
    finally:
        for rows in tops:
            rows.close()
    return run


def _mappings(files: DatasetFiles, tops: Sequence[H5Rows]) -> list[Array]:
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


def _chunk_loop2_epochs(files: DatasetFiles, b: int, cs: int, seed: int, epochs: int) -> LayerRun:
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
                meter = _EpochMeter(run, t0 if e == 0 else None)
                order = [int(c) for c in rng.permutation(range(0, n, cs))]
                pending = pool.submit(read, order[0], slots[0])
                for k, c in enumerate(order):
                    pending.result()
                    if k + 1 < len(order):
                        pending = pool.submit(read, order[k + 1], slots[(k + 1) % 2])
                    perm = rng.permutation(min(c + cs, n) - c)
                    _serve_chunk(slots[k % 2], outs, perm, b, meter)
                meter.end(n)
    finally:
        for fd in fds:
            os.close(fd)
        for rows in tops:
            rows.close()
    return run


def section_tabular(cfg: SpeedConfig, files: DatasetFiles) -> list[str]:
    import asynchdf5

    n, b, cs = files.spec.samples, cfg.image_batch, cfg.tabular_chunk
    epochs = max(3, cfg.layer_epochs)
    cache = 2 * cs * files.spec.sample_bytes
    kwargs: dict[str, Any] = {
        "source": str(files.source),
        "batch_size": b,
        "tops": ("data", "label"),
        "shuffle": True,
        "seed": cfg.seed,
        "chunk_size": cs,
        "cache_bytes": cache,
    }
    loops: list[LayerRun] = []
    layers: list[LayerRun] = []
    copied: list[LayerRun] = []
    errors: list[str] = []
    for _ in range(cfg.rounds):
        sources.warm(files)
        try:
            with _sync_deadline(cfg.deadline_s):
                loops.append(_chunk_loop_epochs(files, b, cs, cfg.seed, epochs))
        except Exception as exc:
            errors.append(f"chunk loop: {_describe(exc)}")
        sources.warm(files)
        _layer_runs(
            layers,
            errors,
            "AsyncHDF5DataLayer",
            partial(asynchdf5.AsyncHDF5DataLayer, **kwargs),
            epochs,
            n,
            cfg.deadline_s,
        )
        _layer_runs(
            copied,
            errors,
            "AsyncHDF5DataLayer(mmap=False)",
            partial(asynchdf5.AsyncHDF5DataLayer, **kwargs, mmap=False),
            epochs,
            n,
            cfg.deadline_s,
        )
    rows: list[Sequence[object]] = []

    def rate(runs: list[LayerRun], e: int) -> float:
        return _rate(n, _median([r.epoch_s[e] for r in runs])) if runs else math.nan

    def steady(runs: list[LayerRun]) -> float:
        return _rate(n, _median([s for r in runs for s in r.later_s])) if runs else math.nan

    for label_, runs in (
        (f"chunk loop, read_direct {cs:,} + take, 1 thread", loops),
        (f'asynchdf5 `AsyncHDF5DataLayer` (default: mmap="auto"), chunk_size {cs:,}', layers),
        (f"asynchdf5 `AsyncHDF5DataLayer(mmap=False)`, chunk_size {cs:,}", copied),
    ):
        rows.append(
            [label_] + [_fmt_rate(rate(runs, e)) for e in range(epochs)] + [_fmt_rate(steady(runs))]
        )
    for label_, runs in (("asynchdf5", layers), ("asynchdf5 `mmap=False`", copied)):
        rows.append(
            [f"{label_} ÷ chunk loop"]
            + [_ratio(rate(runs, e), rate(loops, e)) for e in range(epochs)]
            + [_ratio(steady(runs), steady(loops))]
        )
    notes = [
        f"{label_}: epochs, s: " + "; ".join(", ".join(f"{x:.3f}" for x in r.epoch_s) for r in runs)
        for label_, runs in (
            ("chunk loop", loops),
            ("asynchdf5", layers),
            ("asynchdf5 mmap=False", copied),
        )
        if runs
    ]
    if layers:
        notes.append(f"asynchdf5: {layers[-1].note()}")
    return [
        "## 3. Tabular: asynchdf5 streaming against the single-thread chunk loop",
        "",
        f"{files.spec.title} ({files.spec.total_bytes / 2**30:.2f} GiB), batch {b}, shuffled, "
        f"page cache warm. Both loaders use chunks of {cs:,} rows; asynchdf5's cache is "
        f"`cache_bytes={cache:,}` (two slots, {cache / files.spec.total_bytes:.0%} of the data "
        "set). The chunk loop permutes whole contiguous chunks in a random order; asynchdf5 "
        "fills each chunk from blocks drawn from all over the file (its `block_size` default). "
        "Epoch 1 runs from construction (opening the files, first touch of the buffers); "
        f"samples/s, median over {cfg.rounds} round(s) of one opening each.",
        "",
        *_table(
            ["loader", *[f"epoch {e + 1}" for e in range(epochs)], "steady state (epoch 2+)"],
            rows,
        ),
        "",
        *notes,
        *errors,
    ]


# --------------------------------------------------------------------------------------------
# 4. Event-loop gaps beside a consumer with a training step


def _cpu_step(seconds: float, scratch: Array) -> None:
    """~``seconds`` of work that holds the GIL: a small NumPy op in a loop (too small for NumPy
    to release the GIL), as a Python-side training step would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.multiply(scratch, 1.000001, out=scratch)


@contextlib.contextmanager
def _full_collections() -> Iterator[list[float]]:
    """The durations (s) of the garbage collector's full (generation 2) passes meanwhile: they
    stop every thread that needs the GIL, the event loop's too, for as long as the process's
    heap takes to walk (10-20 ms for this benchmark's ~40,000 objects on the 2-vCPU VMs)."""
    out: list[float] = []
    started: list[float] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                out.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield out
    finally:
        gc.callbacks.remove(note)


async def _probe_run(
    kwargs: dict[str, Any], consumer: str, step_s: float, max_batches: int, epochs: int = 1
) -> tuple[dict[str, float], dict[str, float], dict[str, float], float, int, list[float]]:
    """One opening of ``epochs`` epochs beside the ticker: the gaps before it (the idle floor),
    in its first epoch (opening included), in the later ones; seconds and samples in all; the
    full garbage collections of the opening (their durations)."""
    import asynchdf5

    gaps: list[float] = []
    running = True
    scratch = np.ones(16, np.float64)

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await anyio.sleep(TICK_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    samples = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(IDLE_S)
        idle = len(gaps)
        later = None  # where the second epoch's gaps begin
        t0 = time.perf_counter()
        with _full_collections() as collections:
            async with asynchdf5.AsyncHDF5DataLayer(**kwargs) as layer:
                for epoch in range(epochs):
                    if epoch == 1:
                        later = len(gaps)
                    taken = 0
                    async for batch in layer:
                        taken += batch.size
                        if consumer == "sleep":
                            await anyio.sleep(step_s)
                        elif consumer == "cpu":
                            _cpu_step(step_s, scratch)
                        if max_batches and taken >= max_batches * kwargs["batch_size"]:
                            break
                    samples += taken
        elapsed = time.perf_counter() - t0
        running = False
    first = gaps[idle:later]
    rest = gaps[later:] if later is not None else []
    stats = _gap_stats(gaps[:idle]), _gap_stats(first), _gap_stats(rest)
    return (*stats, elapsed, samples, collections)


#: The pipeline threads' priority in section 4: the default (the main thread's), and 10 below.
PROBE_NICE = ("0", "10")
#: ... and beside other busy processes (one per core), where a lower priority is a lower share.
BUSY_NICE = ("0", "3", "10")


#: A process that spins until its standard input closes: when the benchmark ends, however it
#: ends (the hard stop's ``_exit`` included), its end of the pipe closes and the spinner exits.
_SPINNER = (
    "import os, sys, threading\n"
    "threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()\n"
    "while True: pass\n"
)


@contextlib.contextmanager
def _busy_processes(n: int) -> Iterator[None]:
    """``n`` other Python processes spinning on a core each (this process's priority, same
    session): other ranks of a job, another job's workers, a compile."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE))
        time.sleep(0.2)  # running before the layer opens
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


@contextlib.contextmanager
def _nice_setting(value: str) -> Iterator[None]:
    """``ASYNCHDF5_NICE=value`` while the layers made meanwhile start their threads."""
    before = os.environ.get("ASYNCHDF5_NICE")
    os.environ["ASYNCHDF5_NICE"] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ["ASYNCHDF5_NICE"]
        else:
            os.environ["ASYNCHDF5_NICE"] = before


def _fmt_gcs(durations: list[float]) -> str:
    return f"{len(durations)} ({max(durations) * 1e3:.1f})" if durations else "0"


def section_probe(cfg: SpeedConfig, files: DatasetFiles) -> list[str]:
    kwargs = _image_layer_kwargs(files, cfg)
    step_ms = cfg.step_s * 1e3
    consumers = {
        "none": "does nothing",
        "sleep": f"`await anyio.sleep({cfg.step_s:g})` (GPU-style step)",
        "cpu": f"~{step_ms:g} ms of GIL-holding CPU work (small NumPy op in a loop)",
    }
    rows: list[Sequence[object]] = []
    idle_rows: list[Sequence[object]] = []
    for backend in BACKENDS:
        for consumer, what in consumers.items():
            for nice in PROBE_NICE:  # alternating, so that both see the same machine
                sources.warm(files)
                try:
                    with _nice_setting(nice):
                        idle, busy, steady, elapsed, samples, full_gcs = _run_async(
                            partial(
                                _probe_run,
                                kwargs,
                                consumer,
                                cfg.step_s,
                                cfg.probe_batches,
                                cfg.probe_epochs,
                            ),
                            cfg.deadline_s,
                            backend,
                        )
                except Exception as exc:
                    failed = f"failed: {_describe(exc)}"
                    rows.append([backend, what, nice, failed, *[""] * 9])
                    continue
                rows.append(
                    [
                        backend,
                        what,
                        nice,
                        f"{busy.get('p50_ms', math.nan):.2f}",
                        f"{busy.get('p99_ms', math.nan):.2f}",
                        f"{busy.get('max_ms', math.nan):.1f}",
                        f"{busy.get('stalled_ms_per_s', math.nan):.0f}",
                        f"{steady.get('p99_ms', math.nan):.2f}",
                        f"{steady.get('max_ms', math.nan):.1f}",
                        f"{steady.get('stalled_ms_per_s', math.nan):.0f}",
                        _fmt_gcs(full_gcs),
                        f"{busy.get('ticks', 0) + steady.get('ticks', 0):.0f}",
                        _fmt_rate(_rate(samples, elapsed)),
                    ]
                )
                idle_rows.append(
                    [
                        backend,
                        consumer,
                        nice,
                        f"{idle.get('p50_ms', math.nan):.2f}",
                        f"{idle.get('p99_ms', math.nan):.2f}",
                        f"{idle.get('max_ms', math.nan):.1f}",
                    ]
                )
    busy_n = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    busy_rows: list[Sequence[object]] = []
    for nice in BUSY_NICE:
        sources.warm(files)
        try:
            with _nice_setting(nice), _busy_processes(busy_n):
                _, busy, _, elapsed, samples, _ = _run_async(
                    partial(_probe_run, kwargs, "none", cfg.step_s, cfg.probe_batches),
                    cfg.deadline_s,
                )
        except Exception as exc:
            busy_rows.append([nice, f"failed: {_describe(exc)}", "", "", "", "", ""])
            continue
        busy_rows.append(
            [
                nice,
                f"{busy.get('p50_ms', math.nan):.2f}",
                f"{busy.get('p99_ms', math.nan):.2f}",
                f"{busy.get('max_ms', math.nan):.1f}",
                f"{busy.get('stalled_ms_per_s', math.nan):.0f}",
                f"{elapsed:.2f}",
                _fmt_rate(_rate(samples, elapsed)),
            ]
        )
    span = f"{cfg.probe_batches} batches" if cfg.probe_batches else "one epoch"
    epochs = f"{span} per epoch, {cfg.probe_epochs} epochs per opening per row"
    return [
        "## 4. Event-loop gaps while the consumer trains",
        "",
        f"`AsyncHDF5DataLayer` on the image file ({files.spec.samples:,} samples, the streaming "
        f"configuration of section 2), {epochs}, while a task sleeps "
        f"{TICK_S * 1e3:g} ms in a loop and records the time between its wake-ups (the probe of "
        "`benchmarks/probes.py`). Gaps in ms; `stalled` is the time in gaps over 5 ms per second "
        "of run. The first epoch (opening the files and the ramp included) and the later ones "
        "(the steady state) are apart. The CPU step runs on the event loop's thread, as a "
        "training step written in the coroutine would: the ticker can only run when the consumer "
        "awaits (`async for` hands a group of ready batches over without a trip through the "
        "loop). `ASYNCHDF5_NICE`: how many nice steps below the main thread the pipeline's "
        "threads run (0, the default: at the main thread's priority; 10: below it), the two "
        "alternating. `full GCs`: the garbage collector's full passes in the opening (all "
        "epochs), which stop the event loop for as long as the process's heap takes to walk: "
        "where the longest gap is about as long, it was one of them.",
        "",
        *_table(
            [
                "backend",
                "consumer per batch",
                "`ASYNCHDF5_NICE`",
                "epoch 1: gap p50",
                "p99",
                "max",
                "stalled ms/s",
                "later epochs: p99",
                "max",
                "stalled ms/s",
                "full GCs (longest ms)",
                "ticks",
                "samples/s",
            ],
            rows,
        ),
        "",
        f"Idle floor ({IDLE_S:g} s of ticks before each run):",
        "",
        *_table(["backend", "consumer", "`ASYNCHDF5_NICE`", "p50", "p99", "max"], idle_rows),
        "",
        f"Beside {busy_n} other busy processes (`while True: pass`, one per core, this "
        "process's priority and session), asyncio, a consumer that does nothing, "
        f"{span} per row (the first epoch of an opening only): a thread below the main "
        "thread's priority is below theirs too.",
        "",
        *_table(
            [
                "`ASYNCHDF5_NICE`",
                "gap p50",
                "p99",
                "max",
                "stalled ms/s",
                "s per row",
                "samples/s",
            ],
            busy_rows,
        ),
    ]


# --------------------------------------------------------------------------------------------
# 5. First batch latency; the sync facade against async


async def _first_batch(kwargs: dict[str, Any]) -> tuple[float, float, Any]:
    import asynchdf5

    t0 = time.perf_counter()
    layer = asynchdf5.AsyncHDF5DataLayer(**kwargs)
    async with layer:
        async for _batch in layer:
            first = time.perf_counter() - t0
            break
        else:
            raise AssertionError("no batch")
        stats = layer.stats
        t_close = time.perf_counter()
    return first, time.perf_counter() - t_close, stats


def section_first(cfg: SpeedConfig, files: DatasetFiles) -> list[str]:
    import asynchdf5

    n = files.spec.samples
    base = _image_layer_kwargs(files, cfg)
    rows: list[Sequence[object]] = []
    for chunk in cfg.first_chunks:
        kwargs = base | {"chunk_size": chunk, "cache_bytes": None}
        firsts, closes = [], []
        stats: Any = None
        sources.warm(files)
        try:
            for _ in range(cfg.first_repeats):
                first, close, stats = _run_async(partial(_first_batch, kwargs), cfg.deadline_s)
                firsts.append(first)
                closes.append(close)
        except Exception as exc:
            rows.append([f"{chunk:,}", f"failed: {_describe(exc)}", "", "", "", ""])
            continue
        rows.append(
            [
                f"{chunk:,}",
                f"{_median(firsts) * 1e3:.1f}",
                f"{min(firsts) * 1e3:.1f}",
                f"{_median(closes) * 1e3:.1f}",
                f"{stats.chunk_rows:,}",
                stats.resident,
            ]
        )
    pairs: list[tuple[LayerRun, LayerRun]] = []
    errors: list[str] = []
    epochs = cfg.layer_epochs
    for _ in range(cfg.rounds):
        try:
            sources.warm(files)
            a = _run_async(
                partial(_async_epochs, partial(asynchdf5.AsyncHDF5DataLayer, **base), epochs, n),
                cfg.deadline_s,
            )
            sources.warm(files)
            s = _sync_epochs(partial(asynchdf5.HDF5DataLayer, **base), epochs, n, cfg.deadline_s)
            pairs.append((a, s))
        except Exception as exc:
            errors.append(_describe(exc))
    facade: list[Sequence[object]] = []
    if pairs:
        a_first = _rate(n, _median([a.epoch_s[0] for a, _ in pairs]))
        s_first = _rate(n, _median([s.epoch_s[0] for _, s in pairs]))
        a_later = _rate(n, _median([x for a, _ in pairs for x in a.later_s]))
        s_later = _rate(n, _median([x for _, s in pairs for x in s.later_s]))
        a_fb = _median([a.first_batch_s or math.nan for a, _ in pairs]) * 1e3
        s_fb = _median([s.first_batch_s or math.nan for _, s in pairs]) * 1e3
        facade = [
            [
                "`AsyncHDF5DataLayer`, `async for`",
                _fmt_rate(a_later),
                _fmt_rate(a_first),
                f"{a_fb:.1f}",
            ],
            [
                "`HDF5DataLayer`, `with` / `for`",
                _fmt_rate(s_later),
                _fmt_rate(s_first),
                f"{s_fb:.1f}",
            ],
            ["sync ÷ async", _ratio(s_later, a_later), _ratio(s_first, a_first), ""],
        ]
    return [
        "## 5. First batch latency; the sync facade",
        "",
        f"From `AsyncHDF5DataLayer(...)` (construction) through `async with` to the first batch "
        f"in hand, on the image file ({n:,} samples), shuffled, batch {cfg.image_batch}, "
        f"default `cache_bytes`, page cache warm; {cfg.first_repeats} openings per chunk size. "
        "`close` is leaving `async with` right after (cancelling the run).",
        "",
        *_table(
            ["chunk_size", "first batch ms (median)", "best", "close ms", "chunk_rows", "resident"],
            rows,
        ),
        "",
        "The sync facade against `async for`, streaming configuration of section 2, "
        f"{epochs} epochs per opening, {cfg.rounds} round(s), consumer does nothing:",
        "",
        *_table(["loop", "samples/s (later epochs)", "first epoch", "first batch ms"], facade),
        *(["", *errors] if errors else []),
    ]


# --------------------------------------------------------------------------------------------
# The report


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _header(argv: list[str], started: str, load0: tuple[float, ...], wall_s: float) -> list[str]:
    import asynchdf5

    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load1 = os.getloadavg()
    rows = [
        ("date (UTC)", started),
        ("command", f"`{shlex.join([sys.executable, '-m', 'benchmarks.speed', *argv])}`"),
        (
            "machine",
            f"nproc {nproc} ({os.cpu_count()} logical CPUs), {_cpu_model()}, "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM",
        ),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", platform.python_version()),
        (
            "numpy / h5py (HDF5) / anyio / trio",
            f"{np.__version__} / {h5py.version.version} ({h5py.version.hdf5_version}) / "
            f"{_version('anyio')} / {_version('trio')}",
        ),
        ("asynchdf5", f"{getattr(asynchdf5, '__version__', '?')} (git {_git_head()})"),
        ("load average (1/5/15 min) at start", " / ".join(f"{x:.2f}" for x in load0)),
        ("load average at end", " / ".join(f"{x:.2f}" for x in load1)),
        ("wall time", f"{wall_s / 60:.1f} min"),
    ]
    return ["# asynchdf5 speed measurements (issue 12)", "", *_table(["", ""], rows)]


def run(cfg: SpeedConfig, argv: list[str]) -> str:
    """Every selected section, then the report (header last: it has the end's load)."""
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    want = set(cfg.only or SECTIONS)
    if cfg.gc_freeze:
        gc.collect()
        gc.freeze()

    def image() -> DatasetFiles:
        (files,) = ensure(
            [_suite_set("contiguous", cfg.image_samples, cfg.tabular_rows)], cfg.data_dir
        )
        return files

    def tabular() -> DatasetFiles:
        (files,) = ensure(
            [_suite_set("tabular", cfg.image_samples, cfg.tabular_rows)], cfg.data_dir
        )
        return files

    body: list[str] = []
    steps: list[tuple[str, Callable[[], list[str]]]] = [
        ("batch", lambda: section_batch(cfg)),
        ("ceiling", lambda: section_ceiling(cfg, image())),
        ("tabular", lambda: section_tabular(cfg, tabular())),
        ("probe", lambda: section_probe(cfg, image())),
        ("first", lambda: section_first(cfg, image())),
    ]
    for name, step in steps:
        if name not in want:
            continue
        ts = time.perf_counter()
        try:
            body += ["", *step()]
        except Exception as exc:  # one failed section is a line of the report, not a crash
            traceback.print_exc()
            body += ["", f"## {name}: failed", "", _describe(exc)]
        gc.collect()
        _log(f"{name}: {time.perf_counter() - ts:.1f} s")
    return "\n".join(_header(argv, started, load0, time.perf_counter() - t0) + body) + "\n"


def _parser() -> argparse.ArgumentParser:
    full = SpeedConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.speed",
        description="Issue 12's speed measurements (per-batch cost, the in-RAM ceiling with 1 "
        "and 2 threads, tabular streaming, event-loop gaps, first batch, sync facade), as "
        "ratios taken in one run. Prints a markdown report.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test (< 1 min)")
    p.add_argument("--output", type=Path, help="also write the report to this file")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SECTION",
        help=f"run only these sections ({', '.join(SECTIONS)}); repeatable or comma-separated",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"where the data sets are generated and reused (default {DEFAULT_DATA_DIR})",
    )
    p.add_argument(
        "--samples", type=int, help=f"images (default {full.image_samples:,}; --quick 20,000)"
    )
    p.add_argument(
        "--rows", type=int, help=f"tabular rows (default {full.tabular_rows:,}; --quick 80,000)"
    )
    p.add_argument(
        "--deadline", type=float, help=f"seconds per measurement (default {full.deadline_s:g})"
    )
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() before the sections, as a training script may after its imports: the "
        "garbage collector's full passes then skip what was alive (section 4 counts them)",
    )
    return p


def config_from(args: argparse.Namespace) -> SpeedConfig:
    cfg = SpeedConfig(data_dir=args.data_dir)
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    if args.samples is not None:
        cfg = dataclasses.replace(cfg, image_samples=args.samples)
    if args.rows is not None:
        cfg = dataclasses.replace(cfg, tabular_rows=args.rows)
    if args.deadline is not None:
        cfg = dataclasses.replace(cfg, deadline_s=args.deadline)
    only = tuple(s.strip() for item in args.only for s in item.split(",") if s.strip())
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {', '.join(unknown)}; known: {SECTIONS}")
    return dataclasses.replace(cfg, only=only, gc_freeze=args.gc_freeze)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    text = run(config_from(args), argv)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
