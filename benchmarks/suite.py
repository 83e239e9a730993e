"""Which measurements run on which data set, in what order."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.config import SuiteConfig
from benchmarks.data import DatasetFiles
from benchmarks.measure import Job, Result, run_job

GROUPS = ("raw", "decompress", "ram", "chunkloop", "h5py", "torch", "asynchdf5", "probe")


@dataclass(frozen=True)
class Planned:
    """One measurement of the plan.

    Attributes
    ----------
    group
        Its group (one of :data:`GROUPS`), selectable with ``--only``.
    label
        Its row in the report.
    func
        The measurement, ``"module:function"``.
    bounded
        Time-bounded and extrapolated (the slow loaders) rather than a whole epoch.
    cold
        Run with the data set evicted from the page cache.
    params
        Measurement-specific parameters.
    chunk_size
        Overrides the suite's chunk size.
    """

    group: str
    label: str
    func: str
    bounded: bool = False
    cold: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    chunk_size: int | None = None


def plan(files: DatasetFiles, config: SuiteConfig) -> Iterator[Planned]:
    """The measurements of one data set. Warm-cache runs follow a read of the whole set."""
    gzip = files.spec.layout == "gzip"
    yield Planned(
        "raw",
        "raw preadv, 64 MiB buffer, warm",
        "benchmarks.baselines:raw_read",
        params={"buffer_mib": 64},
    )
    if config.small_buffer_read:
        yield Planned(
            "raw",
            "raw preadv, 4 MiB buffer, warm",
            "benchmarks.baselines:raw_read",
            params={"buffer_mib": 4},
        )
    yield Planned(
        "raw",
        "raw preadv, 64 MiB buffer, cold",
        "benchmarks.baselines:raw_read",
        cold=True,
        params={"buffer_mib": 64},
    )
    if gzip:
        for codec in ("zlib", "isal", "deflate"):
            for threads in config.decompress_threads:
                yield Planned(
                    "decompress",
                    f"decompress only, {codec}, {threads} thread(s)",
                    "benchmarks.baselines:decompress",
                    params={"codec": codec, "threads": threads},
                )
    if files.spec.layout == "contiguous" and files.spec.files == 1:
        # The ceiling does not depend on the layout: the image sets share it (same samples).
        yield Planned("ram", "in-RAM ceiling (np.take)", "benchmarks.baselines:in_ram")
    for chunk in (config.chunk_size, config.stream_chunk_size):
        if chunk:
            yield Planned(
                "chunkloop",
                f"chunk loop, read_direct {chunk:,} + take, 1 thread",
                "benchmarks.baselines:chunk_loop",
                chunk_size=chunk,
            )
    yield Planned(
        "h5py",
        "h5py slabs dset[i:i+65536], in order",
        "benchmarks.baselines:h5py_slab",
        bounded=gzip,
    )
    yield Planned(
        "h5py", "h5py sorted fancy index per batch", "benchmarks.baselines:h5py_fancy", bounded=True
    )
    loaders = config.dataloader_workers if files.spec.name in config.dataloader_sets else ()
    for workers in loaders:
        yield Planned(
            "torch",
            f"DataLoader, per-sample getitem, {workers} workers",
            "benchmarks.torch_loaders:dataloader",
            bounded=True,
            params={"pattern": "sample", "workers": workers},
        )
    for workers in loaders:
        yield Planned(
            "torch",
            f"DataLoader, batch sampler + sorted fancy, {workers} workers",
            "benchmarks.torch_loaders:dataloader",
            bounded=True,
            params={"pattern": "batch", "workers": workers},
        )
    yield Planned(
        "asynchdf5",
        "asynchdf5 AsyncHDF5DataLayer, warm",
        "benchmarks.asynchdf5_loaders:async_layer",
        params={"epochs": 2},
    )
    yield Planned(
        "asynchdf5",
        "asynchdf5 AsyncHDF5DataLayer, cold",
        "benchmarks.asynchdf5_loaders:async_layer",
        cold=True,
    )
    if config.stream_chunk_size:
        yield Planned(
            "asynchdf5",
            f"asynchdf5 AsyncHDF5DataLayer, warm, chunk_size {config.stream_chunk_size:,}",
            "benchmarks.asynchdf5_loaders:async_layer",
            params={"epochs": 2},
            chunk_size=config.stream_chunk_size,
        )
    yield Planned(
        "asynchdf5",
        "asynchdf5 HDF5DataLayer (sync), warm",
        "benchmarks.asynchdf5_loaders:sync_layer",
        params={"epochs": 2},
    )
    if files.spec.name in config.probe_sets:
        for loader in ("naive", "asynchdf5"):
            for tick in ("plain", "h5py"):
                yield Planned(
                    "probe",
                    f"stall probe, {loader}, {tick} tick",
                    "benchmarks.probes:stall_probe",
                    bounded=loader == "naive",
                    params={"loader": loader, "tick": tick},
                )


def selected(planned: Planned, files: DatasetFiles, only: tuple[str, ...]) -> bool:
    """Whether ``--only`` keeps this measurement (names of data sets and groups, combined)."""
    sets = [o for o in only if o not in GROUPS]
    groups = [o for o in only if o in GROUPS]
    return (not sets or files.spec.name in sets) and (not groups or planned.group in groups)


def run(all_files: list[DatasetFiles], config: SuiteConfig, log: bool = True) -> list[Result]:
    """Run the plan of every data set, one subprocess per measurement."""
    results: list[Result] = []
    for files in all_files:
        for p in plan(files, config):
            if not selected(p, files, config.only):
                continue
            job = Job(
                func=p.func,
                label=p.label,
                files=files,
                batch_size=config.batch_size,
                chunk_size=p.chunk_size or config.chunk_size,
                seed=config.seed,
                budget_s=config.budget_s if p.bounded else None,
                cold=p.cold,
                params=p.params | {"group": p.group},
            )
            t0 = time.perf_counter()
            result = run_job(job, config.timeout_s)
            results.append(result)
            if log:
                o = result.outcome
                what = result.error if o is None else f"{o.samples_per_s:,.0f} samples/s"
                print(
                    f"# {files.spec.name:>10} | {p.label:<55} | {what} "
                    f"({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return results
