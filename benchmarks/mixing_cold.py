"""What mixing streams costs out of core: three streams against one source of the same bytes,
each reader in a memory-capped child from a cold page cache (``python -m benchmarks run
mixing-cold``).

:mod:`benchmarks.mixing` measures the pipeline's own cost of mixing on data in the page cache.
This is the case users have: the three files (50, 30 and 20 % of the samples, uint8 3x32x32
images and int64 labels, :func:`benchmarks.mixing.write`) are together several times the memory
the reading process may use. Each reader runs in a child placed in a memory cgroup, with every
file evicted from the page cache before it starts (:func:`benchmarks.out_of_core.run_child`):

- ``sequential``: one thread reading the three files whole, in 8 MiB pieces (the disk's rate);
- ``one``: :class:`asynchdf5.AsyncHDF5DataLayer` over the three files as one source (a list);
- ``streams``: the three files as three streams at their natural shares (the same samples per
  epoch as ``one``, stratified batches);
- ``weighted``: three streams with weights 0.2, 0.3 and 0.5 (the first file downsampled, the
  last upsampled; the same samples per epoch).

All shuffled, default properties, two epochs per child; the readers take turns, round by round.
Reported per reader: the median epoch rate (samples/s) over rounds and epochs, its ratio to the
sequential rate, and each mixed reader's rate and CPU-seconds per GB against ``one``'s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.mixing import SHARES, write
from benchmarks.out_of_core import PIECE_BYTES, SAMPLE_BYTES, derive, run_child
from benchmarks.report import Recorder

#: --quick: a toy set under a small limit (proves the code, not the rate).
QUICK = {"samples": 20_000, "limit_mib": 128, "rounds": 1}
FULL = {"samples": 1_000_000, "limit_mib": 512, "rounds": 2}
READERS = ("sequential", "one", "streams", "weighted")


def files(data_dir: Path, samples: int) -> list[Path]:
    """The three files for ``samples``, written unless a complete set exists."""
    folder = data_dir / f"mixing-cold-{samples}"
    done = folder / "complete"
    paths = [folder / f"mix-{k}.h5" for k in range(len(SHARES))]
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        paths = write(folder, samples)
        done.write_text("written by benchmarks.mixing_cold\n")
    return paths


def job(name: str, paths: list[Path], samples: int) -> dict[str, Any]:
    """The child's job for reader ``name``."""
    base: dict[str, Any] = {
        "path": str(paths[0]),
        "files": [str(p) for p in paths],
        "n": samples,
        "sample_bytes": SAMPLE_BYTES,
        "batch_size": 256,
        "epochs": 2,
        "shuffle": True,
        "seed": 0,
        "layer_props": {},
        "mixing": False,  # the labels are sample numbers, not classes
    }
    if name == "sequential":
        return {**base, "kind": "sequential", "piece_bytes": PIECE_BYTES}
    if name == "one":
        source: Any = [str(p) for p in paths]
    else:
        weights = (None,) * len(paths) if name == "streams" else (0.2, 0.3, 0.5)
        source = {
            "streams": {
                f"s{k}": {"paths": [str(p)], "weight": w}
                for k, (p, w) in enumerate(zip(paths, weights, strict=True))
            }
        }
    return {**base, "kind": "layer", "source": source}


def run(samples: int, limit_mib: int, rounds: int, data_dir: Path) -> dict[str, Any]:
    paths = files(data_dir, samples)
    args = argparse.Namespace(limit_mib=limit_mib, no_cgroup=False, child_timeout=1200.0)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in READERS}
    with tempfile.TemporaryDirectory(prefix="asynchdf5-mixing-cold-") as work:
        for _ in range(rounds):
            for name in READERS:
                r = run_child(name, job(name, paths, samples), paths, args, Path(work))
                derive(r)
                results[name].append(r)
    return {
        "paths": [str(p) for p in paths],
        "bytes": sum(p.stat().st_size for p in paths),
        "results": results,
    }


def bench(rec: Recorder) -> None:
    """Every reader, in rounds, on the same files under the same limit: epoch rates, ratios to
    the sequential read and to one source, CPU-s per GB. Where no memory cgroup can be made the
    children run without one, and a note says why."""
    size = QUICK if rec.quick else FULL
    out = run(size["samples"], size["limit_mib"], size["rounds"], rec.data_dir)
    rec.param(
        samples=size["samples"],
        shares=list(SHARES),
        files_gb=round(out["bytes"] / 1e9, 3),
        limit_mib=size["limit_mib"],
        files_over_limit=round(out["bytes"] / (size["limit_mib"] * 2**20), 2),
        rounds=size["rounds"],
    )
    rate: dict[str, float | None] = {}
    cpu: dict[str, float | None] = {}
    for name, runs in out["results"].items():
        rec.note(f"{name}: {runs[0]['cgroup']}")
        failed = [r for r in runs if r.get("error")]
        for r in failed:
            rec.note(f"{name} failed: {r['error'].strip()[-400:]}")
        passes = [p["rate"] for r in runs if not r.get("error") for p in r["passes"]]
        cpus = [r["cpu_s_per_gb"] for r in runs if r.get("cpu_s_per_gb")]
        rate[name] = statistics.median(passes) if passes else None
        cpu[name] = statistics.median(cpus) if cpus else None
        rec.figure(f"{name}: median epoch rate", rate[name], "samples/s")
        rec.figure(f"{name}: CPU per GB delivered", cpu[name], "CPU-s/GB")
        peaks = [r.get("cgroup_peak_mib") for r in runs if r.get("cgroup_peak_mib")]
        if peaks:
            rec.figure(f"{name}: cgroup peak", max(peaks), "MiB")
        if name != "sequential":
            rec.ratio(f"{name} ÷ sequential read", rate[name], rate["sequential"])
    for name in ("streams", "weighted"):
        rec.ratio(f"{name} ÷ one, samples/s", rate[name], rate["one"])
        rec.ratio(f"{name} ÷ one, CPU-s per GB", cpu[name], cpu["one"])
