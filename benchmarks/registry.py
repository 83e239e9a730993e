"""Every named benchmark: ``python -m benchmarks list`` prints this table.

A benchmark is a function ``bench(rec: report.Recorder) -> None`` in a module of this package: it
reads ``rec.quick`` and ``rec.data_dir``, generates its data with :mod:`benchmarks.data`, and
records figures on ``rec``. To add one, write that function and add a line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.report import Recorder


@dataclass(frozen=True)
class Benchmark:
    """A named benchmark: where its function is, and what it measures (one line)."""

    name: str
    target: str
    summary: str

    def function(self) -> Callable[[Recorder], None]:
        """The benchmark's ``bench`` function (imported now)."""
        module, attr = self.target.split(":")
        fn: Callable[[Recorder], None] = getattr(importlib.import_module(module), attr)
        return fn


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "suite",
            "benchmarks.suite:bench",
            "shuffled epochs against the raw read, the in-RAM ceiling, h5py and DataLoader",
        ),
        Benchmark(
            "ceilings",
            "benchmarks.ceilings:bench",
            "per-batch Python cost; the in-RAM ceiling (1, 2 threads) against the layers",
        ),
        Benchmark(
            "tabular", "benchmarks.tabular:bench", "64-float rows: the layer against a chunk loop"
        ),
        Benchmark(
            "loop-gaps",
            "benchmarks.loop_gaps:bench",
            "event-loop gaps beside a streaming layer and a training step",
        ),
        Benchmark(
            "first-batch",
            "benchmarks.first_batch:bench",
            "time to the first batch per chunk size; the sync facade against async for",
        ),
        Benchmark(
            "step-cost",
            "benchmarks.step_cost:bench",
            "what each loader costs a GIL-holding training step beside it",
        ),
        Benchmark(
            "remote",
            "benchmarks.remote:bench",
            "epochs from a local S3 server with latency, against a parallel download",
        ),
        Benchmark(
            "shuffle-quality",
            "benchmarks.shuffle_quality:bench",
            "label entropy of the planner's epoch orders on class-sorted data (no I/O)",
        ),
        Benchmark(
            "shuffle-training",
            "benchmarks.shuffle_training:bench",
            "test accuracy of a small model trained in each epoch order",
        ),
        Benchmark(
            "block-size",
            "benchmarks.block_size:bench",
            "read rate of random blocks against a sequential read, per block size",
        ),
        Benchmark(
            "out-of-core",
            "benchmarks.out_of_core:bench",
            "cold epochs in a memory cgroup against the sequential rate and the usual loaders",
        ),
        Benchmark(
            "many-files",
            "benchmarks.many_files:bench",
            "thousands of small files against one file: open, first batch, epochs",
        ),
        Benchmark(
            "torch-workers",
            "benchmarks.torch_workers:bench",
            "asynchdf5.torch under DataLoader workers, with a GIL-holding transformer",
        ),
        Benchmark(
            "rss-epochs",
            "benchmarks.rss_epochs:bench",
            "peak RSS after 1 and 10 epochs under a cache budget",
        ),
        Benchmark(
            "gpu",
            "benchmarks.gpu:bench",
            "CuPy delivery against cupy.asarray, torch and the pinned-copy limit (CUDA only)",
        ),
        Benchmark(
            "process-start",
            "benchmarks.process_start:bench",
            "threads or a helper process (process=True): first batch, throughput, RSS",
        ),
        Benchmark(
            "mixing",
            "benchmarks.mixing:bench",
            "several weighted streams in one layer against one stream",
        ),
        Benchmark(
            "ragged",
            "benchmarks.ragged:bench",
            "ragged and sparse rows against a raw read of their bytes; a sparse .h5ad "
            "against AnnLoader; warm and in a 512 MiB cgroup; a sparse .h5ad (and gzipped) "
            "out of core",
        ),
        Benchmark(
            "layouts",
            "benchmarks.layouts:bench",
            "contiguous, chunked, gzip, lzf, split-sample chunks: the layer against the limits",
        ),
        Benchmark(
            "annbatch",
            "benchmarks.annbatch_cells:bench",
            "a sparse .h5ad: asynchdf5 against annbatch on its converted zarr store (Python 3.12+)",
        ),
        Benchmark(
            "windows",
            "benchmarks.windows:bench",
            "token windows (Windows) against nanoGPT's np.memmap get_batch: warm, 512 MiB, mixing",
        ),
        Benchmark(
            "mixing-cold",
            "benchmarks.mixing_cold:bench",
            "three streams against one source, out of core: cold, in a memory cgroup",
        ),
    )
}
