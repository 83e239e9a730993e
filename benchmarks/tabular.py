"""Tabular rows: the layer streaming against a hand-written chunk loop
(``python -m benchmarks run tabular``).

float32[64] + int64 rows in one contiguous HDF5 file. The chunk loop reads whole contiguous
chunks in a random order (``read_direct``, permute, ``np.take`` per batch); the layer fills each
chunk from blocks drawn from all over the file (its ``block_size`` default).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import asynchdf5
from benchmarks import sources
from benchmarks.data import DatasetFiles
from benchmarks.hand_loops import chunk_loop_epochs
from benchmarks.layer_runs import (
    LayerRun,
    Sizes,
    layer_runs,
    median,
    rate,
    sizes,
    sync_deadline,
    tabular_set,
)
from benchmarks.measure import describe
from benchmarks.report import Recorder


def tabular(rec: Recorder, cfg: Sizes, files: DatasetFiles) -> None:
    """Both loaders with chunks of ``cfg.tabular_chunk`` rows, shuffled, page cache warm; the
    layer's cache is two slots (smaller than the data set). Epoch 1 runs from construction."""
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
            with sync_deadline(cfg.deadline_s):
                loops.append(chunk_loop_epochs(files, b, cs, cfg.seed, epochs))
        except Exception as exc:
            errors.append(f"chunk loop: {describe(exc)}")
        sources.warm(files)
        layer_runs(
            layers,
            errors,
            "AsyncHDF5DataLayer",
            partial(asynchdf5.AsyncHDF5DataLayer, **kwargs),
            epochs,
            n,
            cfg.deadline_s,
        )
        layer_runs(
            copied,
            errors,
            "AsyncHDF5DataLayer(mmap=False)",
            partial(asynchdf5.AsyncHDF5DataLayer, **kwargs, mmap=False),
            epochs,
            n,
            cfg.deadline_s,
        )

    def rate_of(runs: list[LayerRun], e: int) -> float | None:
        return rate(n, median([r.epoch_s[e] for r in runs])) if runs else None

    def steady(runs: list[LayerRun]) -> float | None:
        return rate(n, median([s for r in runs for s in r.later_s])) if runs else None

    for label_, runs in (
        (f"chunk loop, read_direct {cs:,} + take, 1 thread", loops),
        (f'AsyncHDF5DataLayer (default: mmap="auto"), chunk_size {cs:,}', layers),
        (f"AsyncHDF5DataLayer(mmap=False), chunk_size {cs:,}", copied),
    ):
        rec.figure(f"{label_}, epoch 1", rate_of(runs, 0), "samples/s")
        rec.figure(f"{label_}, steady state (epoch 2+)", steady(runs), "samples/s")
    for label_, runs in (("asynchdf5", layers), ("asynchdf5 mmap=False", copied)):
        rec.ratio(f"{label_} ÷ chunk loop, epoch 1", rate_of(runs, 0), rate_of(loops, 0))
        rec.ratio(f"{label_} ÷ chunk loop, steady state", steady(runs), steady(loops))
    if layers:
        rec.note(f"asynchdf5: {layers[-1].note()}")
    for e in errors:
        rec.note(e)


def bench(rec: Recorder) -> None:
    """The measurement on the suite's tabular set at this run's size."""
    cfg = sizes(rec)
    rec.param(rows=cfg.tabular_rows, chunk_size=cfg.tabular_chunk, batch=cfg.image_batch)
    tabular(rec, cfg, tabular_set(cfg))
