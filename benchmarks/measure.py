"""Timing, memory sampling, and running each measurement in its own subprocess.

A measurement is a function ``f(job: Job) -> Outcome`` named by ``"module:function"``. The suite
runs ``python -m benchmarks._worker JOB.json RESULT.json`` for each one, so every loader starts
from a fresh interpreter and its peak RSS is its own. Bounded measurements (the slow loaders) time
a few warm-up batches, then batches until the time budget runs out, and extrapolate the epoch.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.data import DatasetFiles

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    """What one measurement subprocess is asked to do.

    Attributes
    ----------
    func
        ``"module:function"`` of the measurement.
    label
        The row's name in the report.
    files
        The data set.
    batch_size, chunk_size, seed
        Loader parameters.
    budget_s
        Time budget after warm-up for a bounded measurement; ``None`` measures the whole epoch.
    cold
        Evict the data set's files from the page cache before measuring.
    params
        Measurement-specific parameters.
    """

    func: str
    label: str
    files: DatasetFiles
    batch_size: int
    chunk_size: int
    seed: int
    budget_s: float | None
    cold: bool = False
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = self.files.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Job:
        return cls(**(d | {"files": DatasetFiles.from_json(d["files"])}))


@dataclass
class Outcome:
    """What a measurement found. Rates are per second of wall time.

    Attributes
    ----------
    samples_per_s
        Samples delivered per second over the (possibly extrapolated) epoch.
    epoch_s
        Wall time of one epoch, first batch included.
    first_batch_s
        From the start (files closed, nothing read) to the first batch in hand.
    extrapolated
        The epoch was not run to the end: ``epoch_s`` is extrapolated from the timed batches.
    timed_samples
        Samples actually delivered.
    bytes_per_s
        Bytes read per second, where the measurement reads bytes rather than samples.
    extra
        Anything else worth reporting (probe gaps, notes).
    """

    samples_per_s: float
    epoch_s: float
    first_batch_s: float | None
    extrapolated: bool = False
    timed_samples: int = 0
    bytes_per_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """One row of the report: the job, its outcome or error, memory and machine load."""

    job: dict[str, Any]
    outcome: Outcome | None
    error: str | None = None
    peak_rss_mib: float | None = None
    start_rss_mib: float | None = None
    children_peak_rss_mib: float | None = None
    load_before: float | None = None
    load_after: float | None = None
    wall_s: float = 0.0

    @property
    def label(self) -> str:
        return str(self.job["label"])

    @property
    def cold(self) -> bool:
        return bool(self.job["cold"])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Result:
        out = d.get("outcome")
        return cls(**(d | {"outcome": Outcome(**out) if out else None}))


class Skip(Exception):
    """Raised by a measurement that cannot run here (missing package, unsupported layout)."""


class EpochClock:
    """Times an epoch batch by batch, and stops a bounded one when its budget is spent.

    Call :meth:`start` when the loader is about to be created, :meth:`batch` with each batch's
    sample count (it returns ``False`` when the caller should stop), and :meth:`outcome` at the end.

    A bounded run (``budget_s`` set) warms up for ``warmup`` batches or half the budget, whichever
    ends first, then times batches for ``budget_s`` (at most three budgets in all), but always at
    least ``min_timed`` of them: a loader whose workers deliver batches in bursts needs a whole
    burst timed. The epoch is extrapolated from the rate of the timed batches.
    """

    def __init__(
        self, total_samples: int, budget_s: float | None, warmup: int = 2, min_timed: int = 1
    ) -> None:
        self.total = total_samples
        self.budget = budget_s
        self.warmup = warmup
        self.min_timed = min_timed
        self.t0 = self.t_last = 0.0
        self.first: float | None = None
        self.samples = 0
        self.batches = 0
        self.t_warm: float | None = None
        self.batches_warm = 0
        self.samples_warm = 0

    def start(self) -> None:
        """Mark the start: nothing is open yet."""
        self.t0 = self.t_last = time.perf_counter()

    def batch(self, n: int) -> bool:
        """Count a batch of ``n`` samples just delivered; ``False`` means stop here."""
        now = self.t_last = time.perf_counter()
        elapsed = now - self.t0
        if self.first is None:
            self.first = elapsed
        self.samples += n
        self.batches += 1
        if self.budget is None:
            return True
        if self.t_warm is None:
            if self.batches >= self.warmup or elapsed >= self.budget / 2:
                self.t_warm, self.batches_warm, self.samples_warm = now, self.batches, self.samples
            return True
        if self.batches - self.batches_warm < self.min_timed:
            return True
        return now - self.t_warm < self.budget and elapsed < 3 * self.budget

    def outcome(self, **extra: Any) -> Outcome:
        """The epoch's outcome, extrapolated if it stopped early (it ends at the last batch)."""
        elapsed = self.t_last - self.t0
        timed = self.samples - self.samples_warm
        if self.samples >= self.total or self.budget is None or self.t_warm is None or timed == 0:
            return Outcome(
                self.samples / elapsed, elapsed, self.first, False, self.samples, extra=extra
            )
        rate = timed / (self.t_last - self.t_warm)
        epoch = (self.t_warm - self.t0) + (self.total - self.samples_warm) / rate
        return Outcome(self.total / epoch, epoch, self.first, True, self.samples, extra=extra)


class _RssSampler(threading.Thread):
    """Samples the summed RSS of the process's children (DataLoader workers) every 50 ms.

    The main process's own peak comes exactly from ``getrusage``; children are sampled because
    they may end before the measurement does. Forked workers share pages with their parent, so
    the sum counts shared pages once per process: an upper bound.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self._stop_event = threading.Event()
        self._me = psutil.Process()

    def run(self) -> None:
        while not self._stop_event.wait(0.05):
            total = 0
            for child in self._me.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # a worker may exit meanwhile
                    total += child.memory_info().rss
            self.peak = max(self.peak, total)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _rss_mib() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def _peak_rss_mib() -> float:
    # VmHWM is the peak RSS of this process's address space since exec. getrusage's ru_maxrss
    # would not do: Linux carries it over exec from the forked parent, so every measurement would
    # report at least the suite runner's own RSS.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB or bytes


def describe(exc: BaseException) -> str:
    """``Type: message (file:line)`` of the innermost cause, unwrapping exception groups."""
    while getattr(exc, "exceptions", None):  # an exception group (anyio task groups raise them)
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def resolve(func: str) -> Callable[[Job], Outcome]:
    """The measurement function named ``"module:function"``."""
    module, name = func.split(":")
    fn: Callable[[Job], Outcome] = getattr(importlib.import_module(module), name)
    return fn


def run_in_process(job: Job) -> Result:
    """Run a measurement in this process (the subprocess side of :func:`run_job`)."""
    from benchmarks import sources

    fn = resolve(job.func)
    if job.cold:
        sources.evict(job.files)
    else:
        # "Warm" must be made true right before the measurement: a VM may page out cache it has
        # not touched for a few seconds (this one runs DAMON with a pageout scheme).
        sources.warm(job.files)
    start_rss = _rss_mib()
    sampler = _RssSampler()
    sampler.start()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    outcome: Outcome | None = None
    error: str | None = None
    try:
        outcome = fn(job)
    except Skip as exc:
        error = f"skipped: {exc}"
    except Exception as exc:  # a failed measurement is a row of the report, not a crash
        error = describe(exc)
        traceback.print_exc()
    wall = time.perf_counter() - t0
    sampler.stop()
    peak = _peak_rss_mib()
    return Result(
        job=job.to_json(),
        outcome=outcome,
        error=error,
        peak_rss_mib=peak,
        start_rss_mib=start_rss,
        children_peak_rss_mib=sampler.peak / 2**20 if sampler.peak else None,
        load_before=load_before,
        load_after=os.getloadavg()[0],
        wall_s=wall,
    )


def run_job(job: Job, timeout_s: float) -> Result:
    """Run a measurement in a fresh interpreter and return its result (or its failure)."""
    with tempfile.TemporaryDirectory(prefix="asynchdf5-bench-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job.to_json()))
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            )
        }
        cmd = [sys.executable, "-m", "benchmarks._worker", str(job_path), str(result_path)]
        t0 = time.perf_counter()
        # A session of its own, so that a measurement that overruns is ended with its workers.
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Result(
                job=job.to_json(),
                outcome=None,
                error=f"timed out after {timeout_s:.0f} s",
                wall_s=time.perf_counter() - t0,
            )
        if result_path.exists():
            return Result.from_json(json.loads(result_path.read_text()))
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return Result(
            job=job.to_json(),
            outcome=None,
            error=f"exit {proc.returncode}: {' | '.join(tail)}",
            wall_s=time.perf_counter() - t0,
        )


def main(argv: list[str]) -> int:
    """Subprocess entry point (see :mod:`benchmarks._worker`)."""
    job = Job.from_json(json.loads(Path(argv[0]).read_text()))
    result = run_in_process(job)
    Path(argv[1]).write_text(json.dumps(result.to_json()))
    return 0
