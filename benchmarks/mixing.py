"""What mixing streams costs (issue 33): three streams against one source of the same bytes.

``python -m benchmarks.mixing [--quick] [--samples N] [--repeats R] [--dir DIR] [--out FILE]``

Writes an image set (uint8 3x32x32 and an int64 label per sample) as three files of 50, 30 and
20 % of the samples, then times shuffled epochs of :class:`asynchdf5.AsyncHDF5DataLayer` over

* ``one``: the three files as one source (a list of paths);
* ``streams``: the same files as three streams at their natural shares (the same samples per
  epoch, so the same bytes), stratified batches;
* ``weighted``: three streams with weights 0.2, 0.3 and 0.5 (the first file downsampled, the
  last upsampled; the same samples per epoch).

Each layer is opened once, runs a warm-up epoch (the files come into the page cache, the slots
are faulted in), then ``repeats`` timed epochs; the layers take turns, round by round, so that
a machine whose load changes affects them alike. Reported: the median epoch rate (samples/s)
of each, and each mixed one's cost against ``one`` (``1 - rate / one's rate``), and the same
in the process's CPU time per sample (steadier than wall time on a shared machine), for the
default properties (``mmap="auto"``: a local file is mapped) and with ``mmap=False`` (copied
through the cache). The data come from the page cache (warm): what is measured is the
pipeline's own cost of mixing (planning, more and smaller ranges per chunk, the serving order).
Results as JSON on stdout (and in ``--out``); :func:`bench` is the entry of the benchmark
suite's registry (``bench(rec)``), recording the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import anyio
import h5py
import numpy as np

from asynchdf5 import AsyncHDF5DataLayer, Stream

SHARES = (0.5, 0.3, 0.2)
BATCH = 256


def write(folder: Path, samples: int) -> list[Path]:
    """Three files of SHARES of ``samples`` images, written in slabs."""
    rng = np.random.default_rng(0)
    sizes = [int(samples * s) for s in SHARES]
    sizes[-1] = samples - sum(sizes[:-1])
    paths = []
    for k, n in enumerate(sizes):
        path = folder / f"mix-{k}.h5"
        with h5py.File(path, "w") as f:
            data = f.create_dataset("data", (n, 3, 32, 32), np.uint8)
            label = f.create_dataset("label", (n,), np.int64)
            for a in range(0, n, 65536):
                b = min(n, a + 65536)
                data[a:b] = rng.integers(0, 256, (b - a, 3, 32, 32), dtype=np.uint8)
                label[a:b] = np.arange(a, b)
        paths.append(path)
    return paths


def layers(paths: list[Path], mmap: bool | str) -> dict[str, AsyncHDF5DataLayer]:
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 0, "mmap": mmap}
    natural = {f"s{k}": Stream([p]) for k, p in enumerate(paths)}
    weighted = {
        f"s{k}": Stream([p], weight=w)
        for k, (p, w) in enumerate(zip(paths, (0.2, 0.3, 0.5), strict=True))
    }
    return {
        "one": AsyncHDF5DataLayer([str(p) for p in paths], **kw),
        "streams": AsyncHDF5DataLayer(natural, **kw),
        "weighted": AsyncHDF5DataLayer(weighted, **kw),
    }


async def measure(paths: list[Path], mmap: bool | str, repeats: int) -> dict[str, Any]:
    made = layers(paths, mmap)
    rates: dict[str, list[float]] = {name: [] for name in made}
    cpu: dict[str, list[float]] = {name: [] for name in made}
    samples: dict[str, int] = {}
    for name, layer in made.items():  # warm-up: one epoch each
        async with layer:
            samples[name] = sum([b.size async for b in layer])
    for _ in range(repeats):
        for name, layer in made.items():
            async with layer:
                t0, c0 = time.perf_counter(), time.process_time()
                n = 0
                async for batch in layer:
                    n += batch.size
                rates[name].append(n / (time.perf_counter() - t0))
                cpu[name].append((time.process_time() - c0) / n * 1e6)
    med = {name: statistics.median(r) for name, r in rates.items()}
    us = {name: statistics.median(c) for name, c in cpu.items()}
    return {
        "mmap": mmap,
        "samples_per_epoch": samples,
        "rates": rates,
        "median_samples_per_s": med,
        "cpu_us_per_sample": cpu,
        "median_cpu_us_per_sample": us,
        "cost": {name: 1 - med[name] / med["one"] for name in made if name != "one"},
        "cpu_cost": {name: us[name] / us["one"] - 1 for name in made if name != "one"},
    }


def run(samples: int, repeats: int, where: Path | None) -> list[dict[str, Any]]:
    """Write the data under ``where`` (a temporary folder, removed after), and measure."""
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="asynchdf5-mixing-", dir=where))
    try:
        paths = write(folder, samples)
        return [anyio.run(measure, paths, m, repeats) for m in ("auto", False)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Recorder(Protocol):
    """What :func:`bench` needs of the benchmark suite's recorder (``benchmarks.report``)."""

    quick: bool
    data_dir: Path

    def figure(self, name: str, value: float | None, unit: str) -> None: ...
    def ratio(self, name: str, num: float | None, den: float | None) -> None: ...
    def param(self, **params: Any) -> None: ...


def bench(rec: Recorder) -> None:
    """The suite's entry (``python -m benchmarks run mixing``): the same measurement, its
    figures recorded as rates and as ratios to one source (wall time and CPU time)."""
    samples, repeats = (20_000, 2) if rec.quick else (200_000, 5)
    rec.param(samples=samples, repeats=repeats, batch_size=BATCH, shares=list(SHARES))
    for result in run(samples, repeats, rec.data_dir):
        mode = "mapped" if result["mmap"] == "auto" else "copied"
        med, us = result["median_samples_per_s"], result["median_cpu_us_per_sample"]
        for name in ("one", "streams", "weighted"):
            rec.figure(f"{name}, {mode}", med[name], "samples/s")
        for name in ("streams", "weighted"):
            rec.ratio(f"{name} ÷ one, {mode}, samples/s", med[name], med["one"])
            rec.ratio(f"{name} ÷ one, {mode}, CPU time per sample", us[name], us["one"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small set, two rounds")
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write the data (a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    samples, repeats = (20_000, 2) if args.quick else (args.samples, args.repeats)
    runs = run(samples, repeats, args.dir)
    results: dict[str, Any] = {
        "benchmark": "mixing",
        "samples": samples,
        "row_bytes": 3 * 32 * 32 + 8,
        "batch_size": BATCH,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    for result in runs:
        med = result["median_samples_per_s"]
        costs = ", ".join(f"{k} {v:+.1%}" for k, v in result["cost"].items())
        cpus = ", ".join(f"{k} {v:+.1%}" for k, v in result["cpu_cost"].items())
        line = (
            f"mmap={result['mmap']!r}: one {med['one']:,.0f} samples/s; cost in wall time: "
            f"{costs}; in CPU time: {cpus}"
        )
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
