"""Thousands of small shard files against the same samples in one file
(``python -m benchmarks run many-files``).

Writes 20,000 small HDF5 files (``--quick``: 200) and one file holding the same
samples, then, for each source in turn, measures what a user waits for:

* **open**: ``async with`` on the layer, which builds the catalog (every file's metadata, read
  once through h5py) and allocates the cache;
* **first batch**: from the start of the first ``async for`` to its first batch;
* **epochs**: samples per second of each shuffled epoch (the page cache is warm: the files were
  just written), and the most descriptors the process held meanwhile (the layer keeps a bounded
  number of files open, under ``ulimit -n`` whatever the file count).

Each source is measured twice: with the default properties (the samples fit the cache, so they
are read in the first epoch and served from memory after it), and *streaming*, with a
``chunk_size`` of a sixteenth of the samples, so that every epoch reads every file again, through
the bounded set of open files.

The run's soft descriptor limit is lowered to 1024 (a common default) first, so the many-files
source is also a check that it opens and reads within it. Data goes to a temporary folder under
the data folder, removed afterwards.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from asynchdf5 import AsyncHDF5DataLayer
from benchmarks import data_special
from benchmarks.report import Recorder

#: Samples per file, and the shape of one sample's ``data`` (float32) beside an int64 label.
ROWS_PER_FILE = 50
SAMPLE_SHAPE = (32,)
BATCH_SIZE = 256
EPOCHS = 2


def _fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return -1


async def measure(source: Path, n: int, chunk_size: int) -> dict[str, Any]:
    """Open time, time to the first batch, and each epoch's rate, for one source."""
    fds_before = _fds()
    most = fds_before
    t0 = time.perf_counter()
    layer = AsyncHDF5DataLayer(
        source, batch_size=BATCH_SIZE, shuffle=True, seed=0, chunk_size=chunk_size
    )
    async with layer:
        open_s = time.perf_counter() - t0
        most = max(most, _fds())
        first_s: float | None = None
        rates = []
        for epoch in range(EPOCHS):
            seen = 0
            t1 = time.perf_counter()
            async for batch in layer:
                if first_s is None:
                    first_s = time.perf_counter() - t1
                seen += batch.size
                if seen % (64 * BATCH_SIZE) < BATCH_SIZE:
                    most = max(most, _fds())
            if seen != n:
                raise AssertionError(f"epoch {epoch} had {seen} samples, not {n}")
            rates.append(n / (time.perf_counter() - t1))
    return {
        "open_s": open_s,
        "first_batch_s": first_s,
        "samples_per_s": rates,
        "descriptors_held_most": most - fds_before,
    }


def run(files: int, data_dir: str | None, nofile: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if nofile and (soft == resource.RLIM_INFINITY or soft > nofile):
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-many-files-", dir=data_dir))
    try:
        t0 = time.perf_counter()
        lst, one = data_special.shard_files(folder, files, ROWS_PER_FILE, SAMPLE_SHAPE)
        written_s = time.perf_counter() - t0
        n = files * ROWS_PER_FILE
        results = {}
        for how, chunk in (("default", 2**20), ("streaming", max(BATCH_SIZE, n // 16))):
            for label, source in (("one file", one), (f"{files} files", lst)):
                results[f"{label}, {how}"] = anyio.run(measure, source, n, chunk)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "files": files,
        "samples": n,
        "sample_bytes": 4 * int(np.prod(SAMPLE_SHAPE)) + 8,
        "batch_size": BATCH_SIZE,
        "write_s": written_s,
        "nofile_soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "results": results,
    }


def bench(rec: Recorder) -> None:
    """Per source (one file, many files) and cache (default, streaming): open, first batch and
    each epoch's rate, and the most descriptors held; ``ulimit -n`` lowered to 1024 first."""
    rec.data_dir.mkdir(parents=True, exist_ok=True)
    result = run(200 if rec.quick else 20_000, str(rec.data_dir), 1024)
    rec.param(**{k: result[k] for k in ("files", "samples", "sample_bytes", "batch_size")})
    rec.param(nofile_soft_limit=result["nofile_soft_limit"])
    rec.figure("writing the files", result["write_s"], "s")
    for label, r in result["results"].items():
        rec.figure(f"{label}: open (catalog)", r["open_s"], "s")
        rec.figure(f"{label}: first batch", r["first_batch_s"], "s")
        for i, x in enumerate(r["samples_per_s"], start=1):
            rec.figure(f"{label}: epoch {i}", x, "samples/s")
        rec.figure(f"{label}: descriptors held (most)", r["descriptors_held_most"], "descriptors")
