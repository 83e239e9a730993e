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

The many files are first opened twice on their own: the **first opening** describes every file
through h5py and keeps the catalog beside the list file; the **second** takes it from there
(each file opened and checked, no h5py). The sources measured after them open as a second does.
``python -m benchmarks.many_files N`` measures only the two openings, at N files (100,000: the
size of source the kept catalog is for).

Each source is measured twice: with the default properties (the samples fit the cache, so they
are read in the first epoch and served from memory after it), and *streaming*, with a
``chunk_size`` of a sixteenth of the samples, so that every epoch reads every file again, through
the bounded set of open files.

The run's soft descriptor limit is lowered to 1024 (a common default) first, so the many-files
source is also a check that it opens and reads within it. Data goes to a temporary folder under
the data folder, removed afterwards.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from asynchdf5 import AsyncHDF5DataLayer
from asynchdf5._catalog_cache import RACY_NS
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


async def open_once(source: Path) -> tuple[float, float]:
    """Seconds that ``async with`` takes to open the layer (the catalog, the cache): wall-clock
    and the process's CPU time (every thread's: on a busy machine, the cost that load does not
    stretch)."""
    t0, c0 = time.perf_counter(), time.process_time()
    async with AsyncHDF5DataLayer(source, batch_size=BATCH_SIZE, shuffle=True, seed=0):
        return time.perf_counter() - t0, time.process_time() - c0


def open_twice(lst: Path) -> dict[str, float]:
    """The first opening (h5py describes every file; the catalog is kept beside ``lst``) and
    the second (from the kept catalog). Files changed within ``RACY_NS`` of an opening are not
    kept, so it waits that long after they were written."""
    time.sleep(RACY_NS / 1e9)
    first, first_cpu = anyio.run(open_once, lst)
    second, second_cpu = anyio.run(open_once, lst)
    kept = lst.parent / f".{lst.name}.asynchdf5-catalog"
    return {
        "first_open_s": first,
        "first_open_cpu_s": first_cpu,
        "second_open_s": second,
        "second_open_cpu_s": second_cpu,
        "kept_catalog_bytes": kept.stat().st_size if kept.exists() else 0,
    }


def _limit_descriptors(nofile: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if nofile and (soft == resource.RLIM_INFINITY or soft > nofile):
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))


def run(files: int, data_dir: str | None, nofile: int) -> dict[str, Any]:
    _limit_descriptors(nofile)
    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-many-files-", dir=data_dir))
    try:
        t0 = time.perf_counter()
        lst, one = data_special.shard_files(folder, files, ROWS_PER_FILE, SAMPLE_SHAPE)
        written_s = time.perf_counter() - t0
        n = files * ROWS_PER_FILE
        opened = open_twice(lst)
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
        **opened,
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
    rec.figure(
        f"{result['files']} files: first open (h5py, catalog kept)", result["first_open_s"], "s"
    )
    rec.figure(f"{result['files']} files: second open (kept catalog)", result["second_open_s"], "s")
    rec.figure("first open: CPU time", result["first_open_cpu_s"], "s")
    rec.figure("second open: CPU time", result["second_open_cpu_s"], "s")
    rec.figure("kept catalog", result["kept_catalog_bytes"], "bytes")
    for label, r in result["results"].items():
        rec.figure(f"{label}: open (catalog)", r["open_s"], "s")
        rec.figure(f"{label}: first batch", r["first_batch_s"], "s")
        for i, x in enumerate(r["samples_per_s"], start=1):
            rec.figure(f"{label}: epoch {i}", x, "samples/s")
        rec.figure(f"{label}: descriptors held (most)", r["descriptors_held_most"], "descriptors")


def main(files: int) -> None:
    """Only the two openings of ``files`` files (in a temporary folder under ``$TMPDIR``)."""
    _limit_descriptors(1024)
    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-many-files-"))
    try:
        t0 = time.perf_counter()
        lst, _ = data_special.shard_files(folder, files, ROWS_PER_FILE, SAMPLE_SHAPE)
        out: dict[str, Any] = {"files": files, "write_s": time.perf_counter() - t0}
        out |= open_twice(lst)
        out["loadavg"] = os.getloadavg()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
