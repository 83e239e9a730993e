"""Shuffled epochs out of core: each reader in a memory-capped child, from a cold page cache
(``python -m benchmarks.out_of_core``).

The data set is one HDF5 file of ``N`` uint8 3x32x32 images (``data``) and int64 labels
(``label``), class-sorted (sample ``i`` is class ``i * 10 // N``), contiguous and uncompressed,
as the packer writes it. By default it is at least four times the memory the reading process
may use: each reader runs in a child process placed in a memory cgroup (:mod:`benchmarks.cgroups`)
of ``--limit-mib``, and the file is evicted from the page cache (``posix_fadvise(DONTNEED)`` on
the file only, never the whole cache) before each reader starts; ``mincore`` says what stayed.

The readers, in one run on the same file under the same limit:

- ``sequential``: one thread, ``os.preadv`` of the whole file in 8 MiB pieces;
- ``layer_unshuffled`` / ``layer_shuffled``: :class:`asynchdf5.AsyncHDF5DataLayer` with default
  properties, ``shuffle=False`` / ``True``, ``--epochs`` epochs in one open (residency of the file
  before the second epoch is reported; label mixing is measured per epoch);
- ``torch_h5py``: a ``DataLoader`` (2 workers, each opening the file) over an h5py map-style
  dataset, random batches from a ``BatchSampler``, one sorted fancy-index read per batch;
- ``memmap``: nanoGPT's loader, a fresh ``np.memmap`` per batch and random indices;
- ``random_at_plan``: the device's random-read rate at the read size the shuffled layer's plan
  uses on this file under this limit (the median of its chunks' ranges, ``data`` bytes), 8
  threads, read-ahead off: the limit of a shuffled epoch that must read from many places;
- ``layer_shuffled_packed``: the shuffled layer on the same samples in a random order, with the
  ``shuffled`` attribute ``asynchdf5 pack --shuffle`` writes: read in sequential stretches, its
  limit is the sequential rate;
- ``layer_unshuffled_packed``: the unshuffled layer on that file: what its shuffled epochs are
  held to (the same bytes, the same file, so the same state of the device's caches);
- ``random_at_packed_plan``: the random-read rate at the read size of the shuffled layer's plan
  on that file (its stretches: a chunk each), 2 threads (as many as the slots in flight): the
  limit of its shuffled epochs, beside the sequential one.

``torch_h5py``, ``memmap`` and the random reads are time-bounded (``--bound-s`` or one epoch,
whichever comes first); the loaders' rate is taken from the first batch on. The limit is the
larger of the sequential read and the unshuffled layer (which keeps several reads in flight);
each rate is reported against it.
Timings depend on the machine's load and, on a VM, on the host's cache of the virtual disk:
compare the ratios of one run, not absolute rates across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import h5py

from benchmarks import cgroups, data_special
from benchmarks.internals import (
    RAMP_TOP_LANES,
    chunk_lanes,
    default_block_rows,
    first_read,
    plan_epoch,
    size_cache,
)
from benchmarks.page_cache import evict, resident_fraction
from benchmarks.report import Recorder, utc_now

SAMPLE_BYTES = 3 * 32 * 32 + 8
PIECE_BYTES = 8 * 2**20
#: name: (child kind, job parameters)
READERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sequential": ("sequential", {}),
    "layer_unshuffled": ("layer", {"shuffle": False}),
    "layer_shuffled": ("layer", {"shuffle": True}),
    "torch_h5py": ("torch_h5py", {"workers": 2}),
    "memmap": ("memmap", {}),
    "random_at_plan": ("random", {"threads": 8}),
    "layer_shuffled_packed": ("layer", {"shuffle": True, "packed_shuffled": True}),
    "layer_unshuffled_packed": ("layer", {"shuffle": False, "packed_shuffled": True}),
    "random_at_packed_plan": ("random", {"threads": 2, "packed_shuffled": True}),
}
#: --quick: a toy file that is smaller than the limit (the run proves the code, not the rate): a
#: child of the layer with default properties is killed for memory under 64 MiB.
QUICK = {"samples": 20_000, "limit_mib": 128, "bound_s": 0.5}
FULL = {"samples": 1_000_000, "limit_mib": 512, "bound_s": 30.0}


def offsets(path: Path) -> tuple[int, int]:
    """Byte offsets of the ``data`` and ``label`` datasets in the file (contiguous layout)."""
    with h5py.File(path, "r") as f:
        d, lab = f["data"].id.get_offset(), f["label"].id.get_offset()
    if d is None or lab is None:
        raise RuntimeError(f"{path}: the datasets are not contiguous and allocated")
    return int(d), int(lab)


def plan_read_bytes(n: int, limit_mib: int, packed: bool = False) -> int:
    """The median read of the shuffled layer's plan over the class-sorted file (``packed``: the
    file packed shuffled, whose chunks are stretches) under a memory limit of ``limit_mib`` (the
    default cache: a third of it), in bytes of ``data``: its chunks' ranges after the first
    read, as the layer plans them with default properties."""
    row, batch, chunk_size = SAMPLE_BYTES, 256, 2**20
    cache = size_cache(
        n, row, batch_size=batch, world_size=1, chunk_size=chunk_size,
        cache_bytes=limit_mib * 2**20 // 3,
    )  # fmt: skip
    if packed:  # blocks of chunk_size rows, no lanes (asynchdf5._sizing.order_of)
        block, (first, lanes), laned, top = chunk_size, first_read(batch, row, False), 1, None
    else:
        block = default_block_rows(row, chunk_size)
        first, lanes = first_read(batch, row, True)
        laned, top = chunk_lanes(cache.chunk_rows, block, row), RAMP_TOP_LANES
    plan = plan_epoch(
        n, epoch=0, batch_size=batch, chunk_size=cache.chunk_rows, shuffle=True, seed=0,
        first_rows=first, block_size=block, ramp_lanes=lanes, chunk_lanes=laned,
        ramp_top_lanes=top, even_chunks=True,
    )  # fmt: skip
    reads = [b - a for c in plan.chunks[1:] or plan.chunks for a, b in c.ranges]
    return int(sorted(reads)[len(reads) // 2]) * (SAMPLE_BYTES - 8)


def shuffled_copy(data_dir: Path, n: int) -> Path:
    """:func:`data_special.shuffled_images`, written by a child process: writing it maps the
    class-sorted file, and a reader's child started after would inherit that peak RSS."""
    code = "import sys; from pathlib import Path; from benchmarks import data_special as d; "
    code += "print(d.shuffled_images(Path(sys.argv[1]), int(sys.argv[2]))[0])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(data_dir), str(n)],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    return Path(proc.stdout.strip().splitlines()[-1])


# --- one reader --------------------------------------------------------------------------------


def run_reader(
    name: str, args: argparse.Namespace, path: Path, n: int, work: Path
) -> dict[str, Any]:
    """One of READERS on ``path`` in a capped child (:func:`run_child`), with derived figures."""
    kind, params = READERS[name]
    if params.get("packed_shuffled"):
        path = shuffled_copy(Path(args.data_dir), n)
    data_offset, label_offset = offsets(path)
    job = {
        "kind": kind,
        "path": str(path),
        "n": n,
        "sample_bytes": SAMPLE_BYTES,
        "batch_size": 256,
        "epochs": args.epochs,
        "bound_s": args.bound_s,
        "seed": 0,
        "piece_bytes": PIECE_BYTES,
        "data_offset": data_offset,
        "label_offset": label_offset,
        "layer_props": args.layer_props,
        "read_bytes": (
            plan_read_bytes(n, args.limit_mib, bool(params.get("packed_shuffled")))
            if kind == "random"
            else None
        ),
        **params,
    }
    result = run_child(name, job, [path], args, work)
    derive(result)
    print(f"# {name}: {_one_line(result)}", file=sys.stderr, flush=True)
    return result


def run_child(
    name: str, job: dict[str, Any], files: list[Path], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """Evict ``files``, make the cgroup (``args.limit_mib``, unless ``args.no_cgroup``), run
    ``job`` in a child (:mod:`benchmarks._ooc_child`), collect its figures and the group's; then
    remove the group."""
    for f in files:
        evict(f)
    sizes = [f.stat().st_size for f in files]
    resident = sum((resident_fraction(f) or 0.0) * b for f, b in zip(files, sizes, strict=True))
    group: cgroups.MemoryCgroup | None = None
    note = "no cgroup (--no-cgroup)"
    if not args.no_cgroup:
        made = cgroups.make(f"asynchdf5-ooc-{os.getpid()}-{name}", args.limit_mib * 2**20)
        if isinstance(made, str):
            note = f"no cgroup: {made}"
        else:
            group, note = made, f"cgroup v{made.version} {made.path}, limit {args.limit_mib} MiB"
    job = {**job, "cgroup_procs": str(group.procs) if group else None}
    job_file, result_file = work / f"{name}.job.json", work / f"{name}.result.json"
    job_file.write_text(json.dumps(job))
    result: dict[str, Any] = {
        "reader": name,
        "cgroup": note,
        "resident_before": resident / max(1, sum(sizes)),
    }
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks._ooc_child", str(job_file), str(result_file)],
            capture_output=True,
            text=True,
            timeout=args.child_timeout,
            cwd=Path(__file__).resolve().parent.parent,
        )
        result["returncode"] = proc.returncode
        if proc.returncode == 0:
            result.update(json.loads(result_file.read_text()))
        else:
            result["error"] = (proc.stderr or proc.stdout)[-2000:] or (
                f"exit status {proc.returncode}"
                + (" (killed by signal 9: out of memory?)" if proc.returncode == -9 else "")
            )
    except subprocess.TimeoutExpired:
        result["returncode"] = None
        result["error"] = f"timed out after {args.child_timeout} s"
    finally:
        result["wall_s"] = time.perf_counter() - t0
        if group is not None:
            result["cgroup_peak_mib"] = _mib(group.peak_bytes())
            result["cgroup_limit_hits"] = group.limit_hits()
            result["cgroup_oom_kills"] = group.oom_kills()
            group.remove()
    return result


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def derive(r: dict[str, Any]) -> None:
    """Per pass, and overall: the rate and CPU-seconds per GB of what was delivered."""
    passes = r.get("passes") or []
    if not passes:
        r["rate"] = None
        return
    r["rate"] = max(p["rate"] for p in passes)
    delivered_gb = sum(p["samples"] for p in passes) * SAMPLE_BYTES / 1e9
    r["cpu_s_per_gb"] = r["cpu_s"] / delivered_gb if delivered_gb else None


def _one_line(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"FAILED ({r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'})"
    rates = ", ".join(f"{p['rate']:,.0f}" for p in r["passes"])
    return f"{rates} samples/s, {r['cpu_s']:.2f} CPU-s"


# --- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.samples
    path, reused = data_special.class_sorted_images(Path(args.data_dir), n)
    size = path.stat().st_size
    names = list(READERS) if not args.only else args.only
    load0 = os.getloadavg()
    started, t0 = utc_now(), time.perf_counter()
    readers: dict[str, Any] = {}
    if any(READERS[k][1].get("packed_shuffled") for k in names):
        shuffled_copy(Path(args.data_dir), n)  # before any reader: its writing is not timed
    with tempfile.TemporaryDirectory(prefix="asynchdf5-ooc-") as work:
        for name in names:
            readers[name] = run_reader(name, args, path, n, Path(work))
    base = [readers[k]["rate"] for k in ("sequential", "layer_unshuffled") if k in readers]
    limit = max((r for r in base if r), default=None)
    for r in readers.values():
        r["ratio_to_limit"] = r["rate"] / limit if limit and r.get("rate") else None
        for p in r.get("passes") or []:
            p["ratio_to_limit"] = p["rate"] / limit if limit else None
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    return {
        "started_utc": started,
        "command": ["python", "-m", "benchmarks.out_of_core", *args.argv],
        "wall_s": wall,
        "load_avg_start": load0,
        "load_avg_end": load1,
        "cpus": os.cpu_count(),
        "file": str(path),
        "file_reused": reused,
        "file_bytes": size,
        "samples": n,
        "limit_mib": None if args.no_cgroup else args.limit_mib,
        "layer_props": args.layer_props,
        "file_over_limit": size / (args.limit_mib * 2**20),
        "limit_samples_per_s": limit,
        "limit_from": [k for k in ("sequential", "layer_unshuffled") if k in readers],
        "readers": readers,
    }


def bench(rec: Recorder) -> None:
    """Every reader, in one run on the same file under the same limit: samples/s per pass, the
    ratio to the limit (the better of the sequential read and the unshuffled layer), CPU-s per
    GB, the first batch and the label entropy ÷ a permutation's. Where no memory cgroup can be
    made (no root, no delegated hierarchy) the children run without one, and a note says why."""
    size = QUICK if rec.quick else FULL
    args = argparse.Namespace(
        argv=["--quick"] if rec.quick else [], samples=size["samples"],
        limit_mib=size["limit_mib"], bound_s=size["bound_s"], no_cgroup=False,
        data_dir=str(rec.data_dir), only=None, epochs=2, layer_props={}, child_timeout=1200.0,
    )  # fmt: skip
    out = run(args)
    rec.param(
        samples=out["samples"],
        file_gb=round(out["file_bytes"] / 1e9, 3),
        limit_mib=args.limit_mib,
        file_over_limit=round(out["file_over_limit"], 2),
    )
    rec.figure(
        "limit (sequential read or unshuffled layer)", out["limit_samples_per_s"], "samples/s"
    )
    readers = out["readers"]
    if readers.get("random_at_plan", {}).get("read_bytes"):
        rec.param(plan_read_kib=readers["random_at_plan"]["read_bytes"] // 2**10)
    if readers.get("random_at_packed_plan", {}).get("read_bytes"):
        rec.param(packed_plan_read_kib=readers["random_at_packed_plan"]["read_bytes"] // 2**10)
    packed = readers.get("layer_shuffled_packed")
    for peer in ("layer_unshuffled", "layer_unshuffled_packed"):
        unshuffled = readers.get(peer)
        if not (packed and unshuffled and packed.get("passes") and unshuffled.get("passes")):
            continue
        for i, (p, q) in enumerate(zip(packed["passes"], unshuffled["passes"], strict=False)):
            rec.figure(
                f"layer_shuffled_packed ÷ {peer}, epoch {i + 1}", p["rate"] / q["rate"], "ratio"
            )
    for name, r in out["readers"].items():
        rec.note(f"{name}: {r['cgroup']}")
        if r.get("error"):
            rec.note(f"{name} failed: {r['error'].strip()[-400:]}")
            continue
        for i, p in enumerate(r["passes"]):
            what = f"{name}, {'epoch ' + str(i + 1) if name.startswith('layer') else 'pass'}"
            rec.figure(f"{what}", p["rate"], "samples/s")
            rec.figure(f"{what} ÷ limit", p.get("ratio_to_limit"), "ratio")
            if p.get("mixing"):
                rec.figure(f"{what}: label entropy ÷ permutation's", p["mixing"]["ratio"], "ratio")
            first = p.get("first_batch_s", r.get("first_batch_s"))
            if first is not None:
                rec.figure(f"{what}: first batch", first, "s")
        rec.figure(f"{name}: CPU per GB delivered", r.get("cpu_s_per_gb"), "CPU-s/GB")
        rec.figure(f"{name}: peak RSS", r.get("maxrss_mib"), "MiB")
        if "stats" in r:
            rec.note(f"{name}: read_paths {r['stats']['read_paths']}; "
                     f"bottleneck: {r['stats']['bottleneck']}")  # fmt: skip


if __name__ == "__main__":  # what the docs named before ``python -m benchmarks run out-of-core``
    from benchmarks.__main__ import main

    sys.exit(main(["run", "out-of-core", *sys.argv[1:]]))
