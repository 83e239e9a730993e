"""DataLoader workers with ``asynchdf5.torch``: samples/s at 0 and 2 workers, warm, with no
transformer, with one that holds the GIL for 2 ms of CPU per batch, and with a CPU-heavy
per-sample Python augmentation (``python -m benchmarks run torch-workers``).

Writes (once) N images (20,000; ``--quick``: 1,024) of 3x64x64 uint8 with an ``int64`` label into
the data folder, reads them once to warm the page cache, then, per transformer, keeps one
``DataLoader(ds, batch_size=None, num_workers=k, persistent_workers=k > 0)`` of
``batch_size=256, shuffle=True`` for each k and times them in blocks: each block is one untimed
epoch of one loader, then ``BLOCK`` timed epochs of it; the blocks alternate between the loaders
(k = 0, 2, 2, 0, 0, 2, ...: each goes first as often). So each side is timed the same way: in a
row of its own epochs (its read-ahead of the next epoch runs during its own epochs, as in
training), never while the other loader is still reading ahead (its idle pipeline and workers
fill their buffers during the untimed epoch, then wait). Timing epochs alternately instead
let each loader's read-ahead run during the other's timed epochs, which costs the side that
needs both cores (the workers) more. The ratio ``num_workers=2 ÷ num_workers=0`` is of the
medians, from one run. Also times what a batch would cost to cross into the main process the way
PyTorch sends tensors: ``share_memory_()`` of a fresh batch tensor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from asynchdf5.torch import HDF5IterableDataset
from benchmarks import data_special
from benchmarks.report import Recorder

BATCH = 256
WORKERS = (0, 2)
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


def rates(
    path: Path, transformer: Callable[[np.ndarray], np.ndarray] | None, rounds: int
) -> dict[int, float]:
    """Median samples/s at each worker count: ``rounds`` blocks per loader (an untimed epoch,
    then :data:`BLOCK` timed ones), alternating, each loader first in every other round."""
    transformers = [("data", transformer)] if transformer is not None else []
    datasets, loaders = [], {}
    for k in WORKERS:
        ds = HDF5IterableDataset(
            path, batch_size=BATCH, shuffle=True, seed=0, transformers=transformers
        )
        datasets.append(ds)
        loaders[k] = DataLoader(ds, batch_size=None, num_workers=k, persistent_workers=k > 0)
    out: dict[int, list[float]] = {k: [] for k in WORKERS}
    try:
        for r in range(rounds):
            for k in WORKERS if r % 2 == 0 else WORKERS[::-1]:
                for e in range(BLOCK + 1):
                    t = time.perf_counter()
                    n = sum(len(b["label"]) for b in loaders[k])
                    if e:  # the first: starts the workers, lets the other's read-ahead end
                        out[k].append(n / (time.perf_counter() - t))
    finally:
        loaders.clear()
        for ds in datasets:
            ds.close()
    return {k: statistics.median(v) for k, v in out.items()}


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
        for k in WORKERS:
            rec.figure(f"{what}, num_workers={k}", got[k], "samples/s")
        rec.ratio(f"{what}: num_workers=2 ÷ num_workers=0", got[2], got[0])
    row = 3 * 64 * 64
    rec.figure("a batch crossing processes: share_memory_()", crossing(row) * 1e3, "ms")
