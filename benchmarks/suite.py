"""Which measurements run on which data set, in what order."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.config import QUICK, SuiteConfig
from benchmarks.data import DatasetFiles, ensure
from benchmarks.measure import Job, Result, run_in_process, run_job
from benchmarks.report import Recorder


@dataclass(frozen=True)
class Planned:
    """One measurement of the plan.

    Attributes
    ----------
    group
        Its group (raw, decompress, ram, chunkloop, h5py, torch, asynchdf5, probe).
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


def run(all_files: list[DatasetFiles], config: SuiteConfig, log: bool = True) -> list[Result]:
    """Run the plan of every data set, one subprocess per measurement."""
    results: list[Result] = []
    for files in all_files:
        for p in plan(files, config):
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
            if config.in_process:
                result = run_in_process(job)
            else:
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


# --------------------------------------------------------------------------------------------
# The benchmark: every measurement of the plan, as figures

#: Labels of the references the ratios divide by.
RAW_WARM = "raw preadv, 64 MiB buffer, warm"
RAW_COLD = "raw preadv, 64 MiB buffer, cold"
IN_RAM = "in-RAM ceiling (np.take)"


def _rate(r: Result | None) -> float | None:
    return r.outcome.samples_per_s if r is not None and r.outcome is not None else None


def record(rec: Recorder, results: list[Result]) -> None:
    """Each measurement's samples/s (and asynchdf5's first batch, later epochs and ratios to
    the raw read of the same cache state, the in-RAM ceiling, h5py and the best DataLoader)."""
    by_set: dict[str, dict[str, Result]] = {}
    for r in results:
        by_set.setdefault(r.job["files"]["spec"]["name"], {})[r.label] = r
    ceiling = next((_rate(s.get(IN_RAM)) for s in by_set.values() if IN_RAM in s), None)
    for name, by in by_set.items():
        torch = [_rate(r) for r in by.values() if r.job["params"].get("group") == "torch"]
        best_torch = max((x for x in torch if x is not None), default=None)
        for label, r in by.items():
            o = r.outcome
            if o is None:
                rec.note(f"{name}: {label}: {r.error}")
                continue
            star = ", extrapolated" if o.extrapolated else ""
            rec.figure(f"{name}: {label}{star}", o.samples_per_s, "samples/s")
            busy = o.extra.get("busy", {})
            if "p99_ms" in busy:
                rec.figure(f"{name}: {label}, event-loop gap p99", busy["p99_ms"], "ms")
                rec.figure(f"{name}: {label}, event-loop gap max", busy["max_ms"], "ms")
            if r.job["params"].get("group") != "asynchdf5":
                continue
            rec.figure(f"{name}: {label}, first batch", o.first_batch_s, "s")
            rec.figure(f"{name}: {label}, peak RSS", r.peak_rss_mib, "MiB")
            epochs = [o.samples_per_s] + [
                float(e["samples_per_s"]) for e in o.extra.get("later_epochs", [])
            ]
            raw = _rate(by.get(RAW_COLD if r.cold else RAW_WARM))
            for i, rate in enumerate(epochs, start=1):
                if i > 1:
                    rec.figure(f"{name}: {label}, epoch {i}", rate, "samples/s")
                what = f"{name}: {label}, epoch {i}"
                rec.ratio(f"{what} ÷ raw read (same cache state)", rate, raw)
                if r.job["files"]["spec"]["kind"] == "image":
                    rec.ratio(f"{what} ÷ in-RAM ceiling", rate, ceiling)
                if best_torch is not None:
                    rec.ratio(f"{what} ÷ best DataLoader", rate, best_torch)


def bench(rec: Recorder) -> None:
    """Shuffled epochs (batch 256) of every loader on the suite's data sets, each measurement in
    its own subprocess (peak RSS its own), against the raw read of the same bytes, the in-RAM
    ceiling, a hand-written chunk loop, plain h5py and PyTorch's DataLoader over h5py. The
    slow loaders are time-bounded and extrapolated (marked)."""
    config = SuiteConfig(data_dir=rec.data_dir)
    if rec.quick:
        config = dataclasses.replace(config, **QUICK)
    sets = [s for s in config.datasets() if s.name in config.sets]
    rec.param(
        sets=[s.title for s in sets],
        batch_size=config.batch_size,
        chunk_size=config.chunk_size,
        stream_chunk_size=config.stream_chunk_size,
        budget_s=config.budget_s,
        in_process=config.in_process,
    )
    record(rec, run(ensure(sets, config.data_dir), config))
