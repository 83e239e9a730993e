"""The layouts users have, each against its limits: ``python -m benchmarks run layouts``.

One table of float32 rows (``data``, smooth values that gzip shrinks to about half) and int64
labels, written with h5py in each layout the tools users have write every day:

- ``contiguous``: h5py's default (and what ``asynchdf5 pack`` writes);
- ``chunked``: uncompressed, chunks of 64 rows (``chunks=`` or ``maxshape=``);
- ``gzip+shuffle`` and ``lzf``: chunks of 64 rows;
- ``split``: gzip chunks that split each sample, AnnData's default for ``X`` (313 x 63);
- ``packed shuffled``: the contiguous file through ``asynchdf5 pack --shuffle``.

Each layout is read by the readers of :mod:`benchmarks._layouts_child` (a raw read of its stored
bytes into one reused buffer and into memory never written before, h5py in order in 256-row
slices, the decode limit for filtered layouts (decoded into reused memory by one loop per core,
the limit the layer is held to; by one executor task per chunk, the looser limit first reported;
and placed at their rows of memory never written before), and a fresh shuffled layer's epochs 1
and 2 with its first batch), warm (page cache filled first) and in a memory cgroup of
``limit`` MiB with the files evicted before each reader (cold); one child per mode, the
readers alternating ``rounds`` times. Figures are the best round of each reader, and
the layer's ratios to the raw reads, to h5py and (filtered) to the decode limit; epoch 2 ÷ the
raw read says what the shuffled gather alone reaches, a bound on epoch 1 too. An unfiltered
data set copied into memory (resident, not mapped): its epoch 1 is also divided by the read
into fresh memory and its epoch 2 (the gather alone) one after the other: where each keeps every
core busy, the least a first epoch that both reads and gathers every row can take; where cores
are left over they overlap, and that ratio flatters the layer. Timings depend on the machine's
load: compare the ratios of one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks import cgroups
from benchmarks.report import Recorder

PARAMS_ATTR = "asynchdf5_layouts"
#: name: h5py keyword arguments of ``data`` (``None``: made by ``asynchdf5 pack --shuffle``).
LAYOUTS: dict[str, dict[str, Any] | None] = {
    "contiguous": {},
    "chunked": {"chunks": (64, -1)},
    "gzip+shuffle": {"chunks": (64, -1), "compression": "gzip", "compression_opts": 4,
                     "shuffle": True},
    "lzf": {"chunks": (64, -1), "compression": "lzf"},
    "split": {"chunks": (313, 63), "compression": "gzip", "compression_opts": 4},
    "packed shuffled": None,
}  # fmt: skip
#: ``page_probe``: time a first write to a page, idle and just freed (a 4 s wait: not at toy size).
QUICK = {"rows": 4_000, "width": 200, "limit_mib": 256, "rounds": 1, "decode_mib": 16,
         "page_probe": False}  # fmt: skip
FULL = {"rows": 100_000, "width": 2_000, "limit_mib": 512, "rounds": 2, "decode_mib": 256,
        "page_probe": True}  # fmt: skip
STEP = 8192


def _values(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Smooth rows: random walks of small steps (gzip+shuffle shrinks them to about half)."""
    return rng.integers(-3, 4, (rows, width)).cumsum(axis=1).astype(np.float32)


def write(folder: Path, name: str, kw: dict[str, Any], rows: int, width: int) -> Path:
    """The layout's file, written unless a complete one with these parameters exists."""
    path = folder / f"{name.replace(' ', '-').replace('+', '-')}.h5"
    params = json.dumps({"kw": kw, "rows": rows, "width": width, "version": 1})
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get(PARAMS_ATTR) == params:
                return path
    except OSError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    kw = dict(kw)
    if "chunks" in kw:
        kw["chunks"] = tuple(width if c == -1 else min(c, width) for c in kw["chunks"])
    rng = np.random.default_rng(0)
    with h5py.File(tmp, "w") as f:
        d = f.create_dataset("data", (rows, width), np.float32, **kw)
        lab = f.create_dataset("label", (rows,), np.int64)
        for a in range(0, rows, STEP):
            b = min(rows, a + STEP)
            d[a:b] = _values(rng, b - a, width)
            lab[a:b] = np.arange(a, b)
        f.attrs[PARAMS_ATTR] = params
    os.replace(tmp, path)
    return path


def packed(folder: Path, contiguous: Path) -> tuple[list[Path], Path]:
    """``asynchdf5 pack --shuffle`` of the contiguous file (reused while it is newer)."""
    out = folder / "packed-shuffled"
    source = out / "train.txt"
    if not source.exists() or source.stat().st_mtime < contiguous.stat().st_mtime:
        subprocess.run(
            [sys.executable, "-m", "asynchdf5", "pack", str(contiguous), str(out), "--shuffle",
             "--overwrite", "--tops", "data", "label"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    names = [line.strip() for line in source.read_text().splitlines() if line.strip()]
    return [out / n for n in names], source


def run_mode(
    layouts: dict[str, Any], cold: bool, limit_mib: int | None, size: dict[str, Any], work: Path
) -> tuple[dict[str, Any], str]:
    """Every layout's readers in one child (in a cgroup of ``limit_mib`` where one can be made)."""
    group: cgroups.MemoryCgroup | None = None
    note = "warm, no cgroup"
    if limit_mib is not None:
        made = cgroups.make(f"asynchdf5-layouts-{os.getpid()}", limit_mib * 2**20)
        if isinstance(made, str):
            note = f"cold, no cgroup: {made}"
        else:
            group, note = made, f"cold, cgroup v{made.version}, limit {limit_mib} MiB"
    job = {
        "layouts": layouts,
        "cold": cold,
        "rounds": size["rounds"],
        "decode_bytes": size["decode_mib"] * 2**20,
        "cgroup_procs": str(group.procs) if group else None,
        "page_probe": size["page_probe"],
    }
    mode = "cold" if cold else "warm"
    job_file, result_file = work / f"{mode}.job.json", work / f"{mode}.result.json"
    job_file.write_text(json.dumps(job))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks._layouts_child", str(job_file), str(result_file)],
            capture_output=True, text=True, timeout=3600,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} child failed: {(proc.stderr or proc.stdout)[-2000:]}")
        result: dict[str, Any] = json.loads(result_file.read_text())
    finally:
        if group is not None:
            peak = group.peak_bytes()
            note += f", peak {peak / 2**20:.0f} MiB" if peak else ""
            group.remove()
    return result, note


def _best(runs: list[dict[str, Any]], key: str = "rate") -> float | None:
    values = [r[key] for r in runs if r.get(key)]
    return max(values) if values else None


def bench(rec: Recorder) -> None:
    """Each layout, warm and cold in a memory cgroup: samples/s of the raw read of its stored
    bytes, h5py in order, the decode limit and the layer (epochs 1 and 2), the layer's ratios to
    them, and its first batch; warm, also the layer's first epoch in memory the host backs and
    what a first write to a page costs in memory idle and just freed (a VM's balloon may take
    idle memory back)."""
    size = QUICK if rec.quick else FULL
    folder = rec.data_dir / f"layouts-{size['rows']}x{size['width']}"
    layouts: dict[str, Any] = {}
    contiguous: Path | None = None
    for name, kw in LAYOUTS.items():
        if kw is None:
            assert contiguous is not None
            paths, source = packed(folder, contiguous)
        else:
            path = write(folder, name, kw, size["rows"], size["width"])
            contiguous = contiguous or path
            paths, source = [path], path
        layouts[name] = {
            "paths": [str(p) for p in paths], "source": str(source), "samples": size["rows"],
            "decoded_bytes": size["rows"] * (4 * size["width"] + 8),
        }  # fmt: skip
    rec.param(rows=size["rows"], width=size["width"], row_bytes=4 * size["width"] + 8,
              limit_mib=size["limit_mib"], rounds=size["rounds"], batch_size=256,
              cpus=os.cpu_count())  # fmt: skip
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="asynchdf5-layouts-") as tmp:
        for cold in (False, True):
            result, note = run_mode(layouts, cold, size["limit_mib"] if cold else None, size,
                                    Path(tmp))  # fmt: skip
            rec.note(note)
            mode = "cold" if cold else "warm"
            pages = result.get("pages")
            if pages:
                rec.figure("first write to a 4 KiB page, memory idle 4 s", pages["idle_us"], "us")
                rec.figure("first write to a 4 KiB page, memory freed just before",
                           pages["recent_us"], "us")  # fmt: skip
            for name, runs in result["layouts"].items():
                what = f"{name}, {mode}"
                raw, h5, dec = (
                    _best(runs["raw"]),
                    _best(runs["h5py"]),
                    _best(runs.get("decode", [])),
                )
                fresh = _best(runs.get("raw_fresh", []))
                fresh_threads = _best(runs.get("raw_fresh_threads", []))
                fill = max((r["threads"] for r in runs.get("raw_fresh_threads", [])), default=0)
                epoch1 = _best(runs["layer"])
                epoch2 = max((r["epochs"][1] for r in runs["layer"]), default=None)
                first = min((r["first_batch_s"] for r in runs["layer"]), default=None)
                rec.figure(f"{what}: raw read of the stored bytes", raw, "samples/s")
                rec.figure(f"{what}: raw read into fresh memory", fresh, "samples/s")
                rec.figure(
                    f"{what}: raw read into fresh memory, {fill} threads", fresh_threads,
                    "samples/s",
                )  # fmt: skip
                rec.figure(f"{what}: h5py in order (256-row slices)", h5, "samples/s")
                rec.figure(f"{what}: decode limit ({os.cpu_count()} threads)", dec, "samples/s")
                loop = _best(runs.get("decode_loop", []))
                rec.figure(
                    f"{what}: decode limit, one loop per core ({os.cpu_count()} threads)", loop,
                    "samples/s",
                )  # fmt: skip
                for key, label in (("decode", "decode limit"), ("decode_loop", "one loop")):
                    for r in runs.get(key, []):
                        if r.get("cpu_seconds") and r.get("chunks"):
                            rec.figure(
                                f"{what}: {label}, CPU per stored chunk",
                                r["cpu_seconds"] / r["chunks"] * 1e6, "us",
                            )  # fmt: skip
                dec_fresh = _best(runs.get("decode_fresh", []))
                rec.figure(
                    f"{what}: decode into fresh memory ({os.cpu_count()} threads)",
                    dec_fresh,
                    "samples/s",
                )
                rec.figure(f"{what}: layer epoch 1", epoch1, "samples/s")
                rec.figure(f"{what}: layer epoch 2", epoch2, "samples/s")
                rec.ratio(f"{what}: layer epoch 1 ÷ raw read", epoch1, raw)
                rec.ratio(f"{what}: layer epoch 1 ÷ raw read into fresh memory", epoch1, fresh)
                rec.ratio(
                    f"{what}: layer epoch 1 ÷ raw read into fresh memory, {fill} threads", epoch1,
                    fresh_threads,
                )  # fmt: skip
                rec.ratio(f"{what}: layer epoch 2 ÷ raw read", epoch2, raw)
                # A resident first epoch both reads every row into fresh memory and gathers it
                # into batches (its epoch 2 alone): where each fills every core, their times add.
                # Unfiltered (a decode would bound it first), copied into memory, not mapped.
                resident = (
                    bool(runs["layer"])
                    and not runs.get("decode")
                    and all(
                        r.get("resident") and "mmap" not in r["read_paths"].values()
                        for r in runs["layer"]
                    )
                )
                floor = (
                    1 / (1 / fresh_threads + 1 / epoch2)
                    if resident and fresh_threads and epoch2
                    else None
                )
                rec.ratio(
                    f"{what}: layer epoch 1 ÷ (raw read into fresh memory, {fill} threads, then "
                    "epoch 2's gather)", epoch1, floor,
                )  # fmt: skip
                rec.ratio(f"{what}: layer epoch 1 ÷ h5py in order", epoch1, h5)
                rec.ratio(f"{what}: layer epoch 1 ÷ decode limit", epoch1, dec)
                rec.ratio(f"{what}: layer epoch 1 ÷ decode limit, one loop per core", epoch1, loop)
                rec.ratio(f"{what}: layer epoch 1 ÷ decode into fresh memory", epoch1, dec_fresh)
                rec.figure(f"{what}: layer first batch", first, "s")
                # The same first epoch in memory the host backs (a machine without a balloon
                # reclaiming freed pages: most of the machines people train on).
                backed = _best(runs.get("layer_backed", []))
                if backed is not None:
                    rec.figure(f"{what}: layer epoch 1, memory backed", backed, "samples/s")
                    for ref, label in (
                        (raw, "raw read"), (h5, "h5py in order"), (dec, "decode limit"),
                        (loop, "decode limit, one loop per core"),
                    ):  # fmt: skip
                        rec.ratio(f"{what}: layer epoch 1, memory backed ÷ {label}", backed, ref)
                last = runs["layer"][-1]
                rec.note(f"{what}: read paths {last['read_paths']}; {last['bottleneck']}")
    rec.note(f"load average {load0} at the start, {os.getloadavg()} at the end")
