"""Event-loop stall probe: does the loader let the event loop run, and does it hold h5py's lock?

Beside the consumer, a ticker coroutine sleeps 1 ms in a loop and records the time between its
wake-ups. With ``tick="h5py"`` it also reads an attribute of another, small HDF5 file on every
tick, on the event loop thread: h5py serialises every call behind one process-wide lock, so if the
loader reads through h5py in a worker thread, the ticker waits for that whole read. Half a second
of ticks before the loader starts gives the idle floor.

Loaders: ``asynchdf5`` (``AsyncHDF5DataLayer``, one epoch) and ``naive`` (the obvious async loader:
``await anyio.to_thread.run_sync`` around an h5py slab read, permute, take; bounded), the second as
a reference that shows what the probe catches.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np

from benchmarks.asynchdf5_loaders import import_asynchdf5, layer_kwargs
from benchmarks.measure import EpochClock, Job, Outcome
from benchmarks.sources import H5Rows

IDLE_S = 0.5
TICK_S = 0.001
NAIVE_SLAB = 65536


async def _asynchdf5_batches(job: Job) -> AsyncGenerator[int, None]:
    asynchdf5 = import_asynchdf5()
    async with asynchdf5.AsyncHDF5DataLayer(**layer_kwargs(job)) as layer:
        async for batch in layer:
            yield len(batch.indices)


async def _naive_batches(job: Job) -> AsyncGenerator[int, None]:
    n, b = job.files.spec.samples, job.batch_size
    rng = np.random.default_rng(job.seed)
    with H5Rows(job.files, "data") as data, H5Rows(job.files, "label") as label:
        slots = [data.empty(NAIVE_SLAB), label.empty(NAIVE_SLAB)]
        outs = [data.empty(b), label.empty(b)]
        for start in rng.permutation(range(0, n, NAIVE_SLAB)):
            stop = min(int(start) + NAIVE_SLAB, n)
            for rows, slot in zip((data, label), slots, strict=True):
                await anyio.to_thread.run_sync(rows.read_direct, int(start), stop, slot)
            perm = rng.permutation(stop - int(start))
            for i in range(0, len(perm), b):
                idx = perm[i : i + b]
                for slot, out in zip(slots, outs, strict=True):
                    np.take(slot, idx, axis=0, out=out[: len(idx)], mode="clip")
                yield len(idx)


def gap_stats(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {}
    ms = np.asarray(gaps) * 1e3
    ends = np.cumsum(ms) / 1e3
    return {
        # When the longest gap began, in seconds from the start of these ticks.
        "max_at_s": float(ends[ms.argmax()] - ms.max() / 1e3),
        "ticks": float(len(ms)),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        # Time the loop spent in gaps over 5 ms, per second of the run.
        "stalled_ms_per_s": float(ms[ms > 5].sum() / (ms.sum() / 1e3)),
    }


def stall_probe(job: Job) -> Outcome:
    """Stream an epoch beside the 1 ms ticker; params: ``loader``, ``tick`` (``plain``/``h5py``)."""
    loader = job.params["loader"]
    h5_tick = job.params["tick"] == "h5py"
    if loader == "asynchdf5":
        import_asynchdf5()  # skip early when the library is not there yet
    clock = EpochClock(job.files.spec.samples, job.budget_s if loader == "naive" else None)
    batches = _asynchdf5_batches if loader == "asynchdf5" else _naive_batches

    with tempfile.TemporaryDirectory(prefix="asynchdf5-probe-") as tmp:
        small = Path(tmp) / "small.h5"
        with h5py.File(small, "w") as f:
            f.attrs["probe"] = 1
        with h5py.File(small, "r") as other:

            async def run() -> tuple[list[float], int]:
                gaps: list[float] = []
                running = True

                async def ticker() -> None:
                    last = time.perf_counter()
                    while running:
                        await anyio.sleep(TICK_S)
                        if h5_tick:
                            other.attrs["probe"]
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now

                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker)
                    await anyio.sleep(IDLE_S)
                    idle = len(gaps)
                    clock.start()
                    async with aclosing(batches(job)) as stream:
                        async for n in stream:
                            if not clock.batch(n):
                                break
                    running = False
                return gaps, idle

            gaps, idle = anyio.run(run, backend=job.params.get("backend", "asyncio"))
    extra: dict[str, Any] = {"idle": gap_stats(gaps[:idle]), "busy": gap_stats(gaps[idle:])}
    extra |= {"loader": loader, "tick": job.params["tick"]}
    return clock.outcome(**extra)
