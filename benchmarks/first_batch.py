"""Time to the first batch, and the sync facade (``python -m benchmarks run first-batch``)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import asynchdf5
from benchmarks import sources
from benchmarks.data import DatasetFiles
from benchmarks.layer_runs import (
    LayerRun,
    Sizes,
    async_epochs,
    image_layer_kwargs,
    image_set,
    median,
    rate,
    run_async,
    sizes,
    sync_epochs,
)
from benchmarks.measure import describe
from benchmarks.report import Recorder


async def _first_batch_of(kwargs: dict[str, Any]) -> tuple[float, float, Any]:
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


def first_batch(rec: Recorder, cfg: Sizes, files: DatasetFiles) -> None:
    """From construction through ``async with`` to the first batch, per chunk size (default
    ``cache_bytes``, warm page cache; ``2**20`` is the default properties, shuffled, batch 256,
    whose goal is 20 ms: median of 5 fresh layers), and the close right after; then the sync
    facade against ``async for`` in the streaming configuration of ``ceilings``."""
    n = files.spec.samples
    base = image_layer_kwargs(files, cfg)
    for chunk in cfg.first_chunks:
        kwargs = base | {"chunk_size": chunk, "cache_bytes": None}
        firsts, closes = [], []
        stats: Any = None
        sources.warm(files)
        try:
            for _ in range(cfg.first_repeats):
                first, close, stats = run_async(partial(_first_batch_of, kwargs), cfg.deadline_s)
                firsts.append(first)
                closes.append(close)
        except Exception as exc:
            rec.note(f"chunk_size {chunk:,}: failed: {describe(exc)}")
            continue
        rec.figure(f"chunk_size {chunk:,}: first batch (median)", median(firsts) * 1e3, "ms")
        rec.figure(f"chunk_size {chunk:,}: close right after", median(closes) * 1e3, "ms")
        rec.note(
            f"chunk_size {chunk:,}: chunk_rows {stats.chunk_rows:,}, resident {stats.resident}"
        )
    pairs: list[tuple[LayerRun, LayerRun]] = []
    errors: list[str] = []
    epochs = cfg.layer_epochs
    for _ in range(cfg.rounds):
        try:
            sources.warm(files)
            a = run_async(
                partial(async_epochs, partial(asynchdf5.AsyncHDF5DataLayer, **base), epochs, n),
                cfg.deadline_s,
            )
            sources.warm(files)
            s = sync_epochs(partial(asynchdf5.HDF5DataLayer, **base), epochs, n, cfg.deadline_s)
            pairs.append((a, s))
        except Exception as exc:
            errors.append(describe(exc))
    if pairs:
        a_first = rate(n, median([a.epoch_s[0] for a, _ in pairs]))
        s_first = rate(n, median([s.epoch_s[0] for _, s in pairs]))
        a_later = rate(n, median([x for a, _ in pairs for x in a.later_s]))
        s_later = rate(n, median([x for _, s in pairs for x in s.later_s]))
        rec.figure("AsyncHDF5DataLayer, async for, later epochs", a_later, "samples/s")
        rec.figure("HDF5DataLayer, with/for, later epochs", s_later, "samples/s")
        rec.ratio("sync ÷ async, later epochs", s_later, a_later)
        rec.ratio("sync ÷ async, first epoch", s_first, a_first)
    for e in errors:
        rec.note(e)


def bench(rec: Recorder) -> None:
    """The measurement on the suite's image set at this run's size."""
    cfg = sizes(rec)
    rec.param(samples=cfg.image_samples, chunks=list(cfg.first_chunks), repeats=cfg.first_repeats)
    first_batch(rec, cfg, image_set(cfg))
