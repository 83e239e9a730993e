"""What the speed benchmarks share: their sizes, deadlines, and epochs of a layer or a
hand-written loop timed the same way (``ceilings``, ``tabular``, ``loop-gaps``, ``first-batch``).

Every async measurement runs under ``anyio.fail_after``, every sync one under a ``SIGALRM``
deadline, and every one under a hard ``faulthandler`` stop, so nothing can hang. The data sets are
the suite's (:mod:`benchmarks.data`), generated at these sizes and reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import math
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar

import anyio
import numpy.typing as npt

from benchmarks.config import DEFAULT_DATA_DIR, DatasetSpec, SuiteConfig
from benchmarks.data import DatasetFiles, ensure
from benchmarks.measure import describe
from benchmarks.report import Recorder
from benchmarks.sources import H5Rows

Backend = Literal["asyncio", "trio"]
BACKENDS: tuple[Backend, ...] = ("asyncio", "trio")
#: Seconds past a measurement's own deadline after which the process is stopped outright.
HARD_GRACE_S = 30.0

T = TypeVar("T")
Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Sizes:
    """Sizes of one run (the defaults take a few minutes on a 2-vCPU machine).

    Attributes
    ----------
    tiny_samples, tiny_batch, tiny_epochs
        ``ceilings``: rows of the tiny arrays, batch size, epochs per configuration.
    image_samples, image_batch, image_chunk
        ``ceilings``, ``loop-gaps``, ``first-batch``: images in the file and in RAM, batch
        size, the streaming chunk size (the cache is two slots of it: smaller than the data set).
    ceiling_epochs, layer_epochs, rounds
        Epochs per ceiling measurement and per layer opening; rounds of (ceilings, layers),
        alternated so that a change of load hits both sides of a ratio.
    tabular_rows, tabular_chunk
        ``tabular``: rows of the tabular file and the chunk size of both loaders.
    step_s
        ``loop-gaps``: the simulated training step (sleep or GIL-holding CPU work) per batch.
    probe_batches, probe_epochs
        ``loop-gaps``: batches per probe epoch (0: a whole epoch), and epochs per opening: the
        first epoch's gaps (opening the files, the ramp) and the later epochs' (the steady
        state) are reported apart.
    probe_backends, probe_consumers, probe_nice, busy_nice
        ``loop-gaps``: the event loops, the consumers' steps, the pipeline's ``ASYNCHDF5_NICE``
        settings measured, and those measured beside one busy process per core.
    first_chunks, first_repeats
        ``first-batch``: chunk sizes for the first-batch latency, and openings per chunk size.
    copy_bytes
        ``ceilings``: bytes of the memory-copy rate's buffers.
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
    probe_backends: tuple[Backend, ...] = BACKENDS
    probe_consumers: tuple[str, ...] = ("none", "sleep", "cpu")
    probe_nice: tuple[str, ...] = ("0", "10")
    busy_nice: tuple[str, ...] = ("0", "3", "10")
    first_chunks: tuple[int, ...] = (2**14, 2**17, 2**20)
    first_repeats: int = 5
    copy_bytes: int = 512 * 2**20
    deadline_s: float = 120.0
    seed: int = 0
    data_dir: Path = DEFAULT_DATA_DIR


#: Toy sizes: every code path in a few seconds per benchmark (the image set is the suite's).
QUICK: dict[str, Any] = {
    "tiny_samples": 8192,
    "tiny_epochs": 2,
    "image_samples": 8192,
    "image_chunk": 2**11,
    "ceiling_epochs": 2,
    "layer_epochs": 2,
    "rounds": 1,
    "tabular_rows": 8192,
    "tabular_chunk": 2**11,
    "probe_batches": 10,
    "probe_epochs": 2,
    "probe_backends": ("asyncio",),
    "probe_consumers": ("none", "cpu"),
    "probe_nice": ("0",),
    "busy_nice": ("0",),
    "first_chunks": (2**11, 2**13),
    "first_repeats": 1,
    "copy_bytes": 16 * 2**20,
    "deadline_s": 30.0,
}


def sizes(rec: Recorder) -> Sizes:
    """The sizes of this run: the full ones, or :data:`QUICK`."""
    base = Sizes(data_dir=rec.data_dir)
    return dataclasses.replace(base, **QUICK) if rec.quick else base


def image_set(cfg: Sizes) -> DatasetFiles:
    """The suite's contiguous image set at these sizes (generated if missing)."""
    (files,) = ensure([suite_set("contiguous", cfg.image_samples, cfg.tabular_rows)], cfg.data_dir)
    return files


def tabular_set(cfg: Sizes) -> DatasetFiles:
    """The suite's tabular set at these sizes (generated if missing)."""
    (files,) = ensure([suite_set("tabular", cfg.image_samples, cfg.tabular_rows)], cfg.data_dir)
    return files


# --------------------------------------------------------------------------------------------
# Deadlines and small helpers


@contextlib.contextmanager
def hard_stop(seconds: float) -> Iterator[None]:
    """Stop the process (with every thread's traceback) if the block overruns by far."""
    faulthandler.dump_traceback_later(seconds + HARD_GRACE_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def sync_deadline(seconds: float) -> Iterator[None]:
    """``TimeoutError`` in the main thread after ``seconds`` (a real signal, so that it also
    interrupts a wait on a lock), and the hard stop behind it."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"sync measurement overran its {seconds:g} s deadline")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with hard_stop(seconds):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_async(fn: Callable[[], Awaitable[T]], seconds: float, backend: Backend = "asyncio") -> T:
    """``fn()`` on a fresh event loop, under ``anyio.fail_after(seconds)`` and the hard stop."""

    async def bounded() -> T:
        try:
            with anyio.fail_after(seconds):
                return await fn()
        except TimeoutError as exc:
            raise TimeoutError(f"async measurement overran its {seconds:g} s deadline") from exc

    with hard_stop(seconds):
        return anyio.run(bounded, backend=backend)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def rate(samples: int, seconds: float) -> float:
    return samples / seconds if seconds > 0 else math.nan


def suite_set(name: str, image_samples: int, tabular_rows: int) -> DatasetSpec:
    """The suite's data set ``name`` at these sizes: the same definition, the same bytes."""
    sets = SuiteConfig(image_samples=image_samples, tabular_rows=tabular_rows).datasets()
    return next(spec for spec in sets if spec.name == name)


def load_arrays(files: DatasetFiles) -> tuple[Array, Array]:
    """Both tops of a data set, read whole into RAM."""
    out = []
    for top in ("data", "label"):
        with H5Rows(files, top) as rows:
            arr = rows.empty(len(rows))
            rows.read_direct(0, len(rows), arr)
            out.append(arr)
    return out[0], out[1]


# --------------------------------------------------------------------------------------------
# Epochs of a layer or a hand-written loop


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


class EpochMeter:
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


def layer_runs(
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
        runs.append(run_async(partial(async_epochs, make, epochs, n), deadline_s))
    except Exception as exc:
        errors.append(f"{what}: {describe(exc)}")


async def async_epochs(make: Callable[[], Any], epochs: int, n: int) -> LayerRun:
    """``epochs`` epochs of ``async for`` over ``make()``, the clock started before ``make``."""
    run = LayerRun()
    t0 = time.perf_counter()
    layer = make()
    async with layer:
        for e in range(epochs):
            meter = EpochMeter(run, t0 if e == 0 else None)
            async for batch in layer:
                meter.batch(batch.size)
            meter.end(n)
        run.stats = layer.stats
        t_close = time.perf_counter()
    run.close_s = time.perf_counter() - t_close
    return run


def sync_epochs(make: Callable[[], Any], epochs: int, n: int, deadline_s: float) -> LayerRun:
    """The same with ``with`` / ``for`` (the sync facade), under a deadline."""
    run = LayerRun()
    with sync_deadline(deadline_s):
        t0 = time.perf_counter()
        layer = make()
        with layer:
            for e in range(epochs):
                meter = EpochMeter(run, t0 if e == 0 else None)
                for batch in layer:
                    meter.batch(batch.size)
                meter.end(n)
            run.stats = layer.stats
            t_close = time.perf_counter()
        run.close_s = time.perf_counter() - t_close
    return run


def image_layer_kwargs(files: DatasetFiles, cfg: Sizes) -> dict[str, Any]:
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
