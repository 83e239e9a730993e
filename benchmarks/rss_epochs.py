"""Peak RSS after 1 and after 10 epochs under a cache budget (`python -m benchmarks.rss_epochs`).

Checks the bounded-memory claim: peak RSS stays within ``cache_bytes`` plus a small constant, and
does not grow from epoch 1 to epoch 10. Uses the contiguous image set the suite generates.
"""

from __future__ import annotations

import argparse
import time

import anyio

from asynchdf5 import AsyncHDF5DataLayer


def vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def run(source: str, cache_bytes: int, epochs: int) -> None:
    layer = AsyncHDF5DataLayer(
        source, batch_size=256, shuffle=True, seed=0, cache_bytes=cache_bytes, chunk_size=2**20
    )
    async with layer:
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            n = 0
            async for batch in layer:
                n += len(batch.indices)
            dt = time.perf_counter() - t0
            print(
                f"epoch {epoch:2d}: {n / dt:>12,.0f} samples/s  peak RSS {vm_hwm_mib():8.0f} MiB"
                f"  (budget {cache_bytes / 2**20:.0f} MiB, chunk rows {layer.stats.chunk_rows})",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--source", default="/tmp/asynchdf5-bench/contiguous-1000000/contiguous.h5")
    p.add_argument("--cache-mib", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=10)
    a = p.parse_args()
    anyio.run(run, a.source, a.cache_mib * 2**20, a.epochs)


if __name__ == "__main__":
    main()
