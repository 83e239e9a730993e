"""Peak RSS after 1 and after 10 epochs under a cache budget
(``python -m benchmarks run rss-epochs``).

Checks the bounded-memory claim: peak RSS stays within ``cache_bytes`` plus a small constant, and
does not grow from epoch 1 to epoch 10. Uses the suite's contiguous image set.
"""

from __future__ import annotations

import time

import anyio

from asynchdf5 import AsyncHDF5DataLayer
from benchmarks.config import SuiteConfig
from benchmarks.data import ensure
from benchmarks.report import Recorder


def vm_hwm_mib() -> float:
    """This process's peak RSS (``VmHWM``), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def epochs(rec: Recorder, source: str, cache_bytes: int, chunk_size: int, n: int) -> None:
    """``n`` shuffled epochs; samples/s and peak RSS after epochs 1 and ``n``."""
    layer = AsyncHDF5DataLayer(
        source, batch_size=256, shuffle=True, seed=0, cache_bytes=cache_bytes, chunk_size=chunk_size
    )
    async with layer:
        for epoch in range(1, n + 1):
            t0 = time.perf_counter()
            seen = 0
            async for batch in layer:
                seen += len(batch.indices)
            if epoch in (1, n):
                rec.figure(f"epoch {epoch}", seen / (time.perf_counter() - t0), "samples/s")
                rec.figure(f"peak RSS after epoch {epoch}", vm_hwm_mib(), "MiB")
        rec.param(chunk_rows=layer.stats.chunk_rows)


def bench(rec: Recorder) -> None:
    """Ten epochs of the image set (1,000,000 samples; ``--quick``: 8,192, 3 epochs) through a
    1 GiB cache (``--quick``: 8 MiB)."""
    samples, cache, chunk, n = (8192, 8 * 2**20, 2**11, 3) if rec.quick else (
        1_000_000, 2**30, 2**20, 10
    )  # fmt: skip
    (spec,) = [s for s in SuiteConfig(image_samples=samples).datasets() if s.name == "contiguous"]
    (files,) = ensure([spec], rec.data_dir)
    rec.param(samples=samples, cache_mib=cache / 2**20, chunk_size=chunk, epochs=n)
    rec.figure("cache budget", cache / 2**20, "MiB")
    anyio.run(epochs, rec, str(files.source), cache, chunk, n)
