"""DataLoader workers with ``asynchdf5.torch``: samples/s at 0 and k workers, warm, with and without
a CPU-heavy Python transformer (a per-sample augmentation that holds the GIL)
(``python -m benchmarks run torch-workers``).

Writes (once) N images (20,000; ``--quick``: 1,024) of 3x64x64 uint8 with an ``int64`` label into
the data folder, reads them once to warm the page cache, then times whole epochs of
``batch_size=256, shuffle=True`` through ``DataLoader(ds, batch_size=None, num_workers=k)`` after
one untimed epoch, and records the median of the repeats. Also times what each batch costs to
cross into the main process: ``share_memory_()`` of a fresh batch tensor, the copy torch makes of
every batch a worker sends.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from asynchdf5.torch import HDF5IterableDataset
from benchmarks import data_special
from benchmarks.report import Recorder

BATCH = 256


def augment(x: np.ndarray) -> np.ndarray:
    """A CPU-heavy transformer: per sample, a random flip and noise, in a Python loop."""
    rng = np.random.default_rng(int(x[0, 0, 0, 0]))
    out = np.empty_like(x)
    for i in range(len(x)):
        s = x[i, :, :, ::-1] if rng.random() < 0.5 else x[i]
        noisy = s.astype(np.int16) + rng.integers(-8, 9, s.shape, dtype=np.int16)
        out[i] = np.clip(noisy, 0, 255)
    return out


def rate(path: Path, workers: int, heavy: bool, repeats: int) -> float:
    transformers = [("data", augment)] if heavy else []
    ds = HDF5IterableDataset(
        path, batch_size=BATCH, shuffle=True, seed=0, transformers=transformers
    )
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    rates = []
    try:
        for e in range(repeats + 1):
            t = time.perf_counter()
            n = sum(len(b["label"]) for b in loader)
            if e:  # the first epoch starts the workers and the pipeline
                rates.append(n / (time.perf_counter() - t))
    finally:
        del loader
        ds.close()
    return statistics.median(rates)


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
    """Median samples/s of the timed epochs at 0 and 2 workers, with and without the Python
    augmentation, and the cost of one batch's ``share_memory_()``."""
    n, repeats = (1024, 1) if rec.quick else (20_000, 3)
    path = data_special.large_images(rec.data_dir / f"torch-workers-{n}", n)
    with open(path, "rb") as f:  # warm
        while f.read(2**24):
            pass
    rec.param(images=n, shape="3x64x64 uint8", batch=BATCH, repeats=repeats, shuffle=True)
    for heavy in (False, True):
        for k in (0, 2):
            what = "augment (Python, per sample)" if heavy else "no transformer"
            rec.figure(f"{what}, num_workers={k}", rate(path, k, heavy, repeats), "samples/s")
    row = 3 * 64 * 64
    rec.figure("a batch crossing processes: share_memory_()", crossing(row) * 1e3, "ms")
