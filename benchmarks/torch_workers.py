"""DataLoader workers with ``asynchdf5.torch``: samples/s at 0 and 2 workers, warm, with no
transformer, with one that holds the GIL for 2 ms of CPU per batch, and with a CPU-heavy
per-sample Python augmentation (``python -m benchmarks run torch-workers``); and PyTorch's own
ceiling: a dataset that hands over one ready batch, at 0 and 2 workers.

Writes (once) N images (20,000; ``--quick``: 1,024) of 3x64x64 uint8 with an ``int64`` label into
the data folder, reads them once to warm the page cache, then, per transformer, keeps one
``DataLoader(ds, batch_size=None, num_workers=k, persistent_workers=k > 0)`` of
``batch_size=256, shuffle=True`` for each k (and one more at k = 2 with ``prefetch_factor=4``:
more batches in flight per worker) and times them in blocks: each block is one untimed epoch of
one loader, then ``BLOCK`` timed epochs of it; the blocks alternate between the loaders (each
goes first as often, the order reversed every other round). So each side is timed the same way:
in a row of its own epochs (its read-ahead of the next epoch runs during its own epochs, as in
training), never while the other loader is still reading ahead (its idle pipeline and workers
fill their buffers during the untimed epoch, then wait). Timing epochs alternately instead
let each loader's read-ahead run during the other's timed epochs, which costs the side that
needs both cores (the workers) more. The ratio ``num_workers=2 ÷ num_workers=0`` is of the
medians, from one run. Also times what a batch would cost to cross into the main process the way
PyTorch sends tensors: ``share_memory_()`` of a fresh batch tensor.

The ceiling (:func:`ceiling`): a dataset whose every batch is the same ready one (in a worker,
lying in shared memory and crossing as these datasets' batches do, through a
:class:`~asynchdf5.torch._shared.Ring`), timed the same way at 0 and 2 workers, with the CPU of
the main process and of the workers per batch. At 2 workers that is PyTorch's hand-off alone
(the worker's loop, a message each way, the main process's wait): what a batch costs there
beyond the layer's own work.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from asynchdf5._batch import Batch
from asynchdf5.torch import HDF5IterableDataset
from asynchdf5.torch._shared import Ring
from benchmarks import data_special
from benchmarks.report import Recorder

BATCH = 256
WORKERS = (0, 2)
#: The loaders timed against each other: (label, num_workers, the DataLoader's other arguments).
LOADERS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("num_workers=0", 0, {}),
    ("num_workers=2", 2, {}),
    ("num_workers=2, prefetch_factor=4", 2, {"prefetch_factor": 4}),
)
#: Timed epochs per block, after the block's untimed one.
BLOCK = 2


def augment(x: np.ndarray) -> np.ndarray:
    """A CPU-heavy transformer: per sample, a random flip and noise, in a Python loop."""
    rng = np.random.default_rng(int(x[0, 0, 0, 0]))
    out = np.empty_like(x)
    for i in range(len(x)):
        s = x[i, :, :, ::-1] if rng.random() < 0.5 else x[i]
        noisy = s.astype(np.int16) + rng.integers(-8, 9, s.shape, dtype=np.int16)
        out[i] = np.clip(noisy, 0, 255)
    return out


def python_2ms(x: np.ndarray) -> np.ndarray:
    """A transformer costing 2 ms of CPU per batch, all of it holding the GIL (pure Python)."""
    end = time.thread_time() + 0.002
    while time.thread_time() < end:
        pass
    return x


TRANSFORMERS: dict[str, Callable[[np.ndarray], np.ndarray] | None] = {
    "no transformer": None,
    "2 ms of GIL-holding Python per batch": python_2ms,
    "augment (Python, per sample)": augment,
}


def _order(labels: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the loaders: rotated by one each round, reversed every other."""
    order = labels[r % len(labels) :] + labels[: r % len(labels)]
    return order[::-1] if r % 2 else order


def rates(
    path: Path, transformer: Callable[[np.ndarray], np.ndarray] | None, rounds: int
) -> dict[str, float]:
    """Median samples/s of each of :data:`LOADERS`: ``rounds`` blocks per loader (an untimed
    epoch, then :data:`BLOCK` timed ones), alternating (:func:`_order`)."""
    transformers = [("data", transformer)] if transformer is not None else []
    datasets, loaders = [], {}
    for label, k, extra in LOADERS:
        ds = HDF5IterableDataset(
            path, batch_size=BATCH, shuffle=True, seed=0, transformers=transformers
        )
        datasets.append(ds)
        loaders[label] = DataLoader(
            ds, batch_size=None, num_workers=k, persistent_workers=k > 0, **extra
        )
    out: dict[str, list[float]] = {label: [] for label in loaders}
    try:
        for r in range(rounds):
            for label in _order(list(loaders), r):
                for e in range(BLOCK + 1):
                    t = time.perf_counter()
                    n = sum(len(b["label"]) for b in loaders[label])
                    if e:  # the first: starts the workers, lets the other's read-ahead end
                        out[label].append(n / (time.perf_counter() - t))
    finally:
        loaders.clear()
        for ds in datasets:
            ds.close()
    return {label: statistics.median(v) for label, v in out.items()}


class ReadyBatch(IterableDataset[Any]):
    """``batches`` batches per epoch (split among workers as the layer's datasets split
    theirs), each the same ready one of :data:`BATCH` 3x64x64 uint8 images and int64 labels: in
    a worker, lying in a :class:`Ring`'s shared memory and sent as the layer's batches are."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self._ring: Ring | None = None
        self._batch: Batch | None = None

    def _ready(self) -> Batch:
        if self._batch is None:
            row = 3 * 64 * 64
            if get_worker_info() is not None:
                self._ring = Ring()
                memory = self._ring.empty(BATCH * (row + 8))
            else:
                memory = np.zeros(BATCH * (row + 8), np.uint8)
            data = {
                "data": memory[: BATCH * row].reshape(BATCH, 3, 64, 64),
                "label": memory[BATCH * row :].view(np.int64),
            }
            self._batch = Batch(data, np.arange(BATCH), 0)
        return self._batch

    def __iter__(self) -> Iterator[Any]:
        batch, worker = self._ready(), get_worker_info()
        k, i = (1, 0) if worker is None else (worker.num_workers, worker.id)
        per = -(-self.batches // k)
        for _ in range(i * per, min(self.batches, (i + 1) * per)):
            if self._ring is not None:
                yield self._ring.pack(batch, None)
            else:
                yield {name: torch.from_numpy(a) for name, a in batch.items()}


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, summed over its live threads, from each thread's
    ``/proc/PID/task/TID/schedstat`` (nanoseconds: finer than ``stat``'s clock ticks, which a
    short ``--quick`` run would see as 0)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return total / 1e9


def ceiling(batches: int, rounds: int, epochs: int) -> dict[int, tuple[float, float, float]]:
    """Per worker count: median ms per batch of :class:`ReadyBatch` (``rounds`` alternating
    blocks of an untimed epoch and ``epochs`` timed ones), and the CPU ms per batch of the main
    process and of the workers together over all timed epochs."""
    loaders = {
        k: DataLoader(ReadyBatch(batches), batch_size=None, num_workers=k, persistent_workers=k > 0)
        for k in WORKERS
    }
    walls: dict[int, list[float]] = {k: [] for k in WORKERS}
    cpu = {k: [0.0, 0.0] for k in WORKERS}
    for r in range(rounds):
        for k in WORKERS if r % 2 == 0 else WORKERS[::-1]:
            loader = loaders[k]
            for _ in loader:
                pass  # untimed: starts the workers
            it: Any = loader._iterator
            pids = [w.pid for w in it._workers] if k else []
            main, workers = time.process_time(), sum(map(_cpu_seconds, pids))
            t = time.perf_counter()
            n = sum(1 for _ in range(epochs) for _ in loader)
            walls[k].append((time.perf_counter() - t) / n)
            cpu[k][0] += (time.process_time() - main) / (n * rounds)
            cpu[k][1] += (sum(map(_cpu_seconds, pids)) - workers) / (n * rounds)
    loaders.clear()
    return {
        k: (statistics.median(walls[k]) * 1e3, cpu[k][0] * 1e3, cpu[k][1] * 1e3) for k in WORKERS
    }


def crossing(row_bytes: int) -> float:
    """Seconds per batch of ``share_memory_()`` on a fresh batch tensor (median of 50)."""
    times = []
    for _ in range(50):
        t = torch.from_numpy(np.ones(BATCH * row_bytes, np.uint8))
        s = time.perf_counter()
        t.share_memory_()  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - s)
    return statistics.median(times)


def bench(rec: Recorder) -> None:
    """Per transformer, median samples/s at 0 and 2 workers and their ratio (blocks of epochs
    alternating in one run), and the cost of one batch's ``share_memory_()``."""
    n, rounds = (1024, 1) if rec.quick else (20_000, 4)
    path = data_special.large_images(rec.data_dir / f"torch-workers-{n}", n)
    with open(path, "rb") as f:  # warm
        while f.read(2**24):
            pass
    rec.param(
        images=n, shape="3x64x64 uint8", batch=BATCH, rounds=rounds, block=BLOCK, shuffle=True
    )
    for what, transformer in TRANSFORMERS.items():
        if rec.quick and transformer is augment:
            continue  # the slowest; the two others run the same code
        got = rates(path, transformer, rounds)
        for label, _, _ in LOADERS:
            rec.figure(f"{what}, {label}", got[label], "samples/s")
        for label, k, _ in LOADERS:
            if k:
                rec.ratio(f"{what}: {label} ÷ num_workers=0", got[label], got["num_workers=0"])
    batches = -(-n // BATCH)
    for k, (wall, main, workers) in ceiling(batches, rounds, 10 if not rec.quick else 2).items():
        rec.figure(f"ceiling (a ready batch), num_workers={k}: wall per batch", wall, "ms")
        rec.figure(f"ceiling, num_workers={k}: main process CPU per batch", main, "ms")
        if k:
            rec.figure(f"ceiling, num_workers={k}: workers' CPU per batch", workers, "ms")
    row = 3 * 64 * 64
    rec.figure("a batch crossing processes: share_memory_()", crossing(row) * 1e3, "ms")
