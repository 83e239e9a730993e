"""The markdown report: machine, data sets, results per data set, asynchdf5's ratios, probes."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import h5py
import numpy as np
import psutil

from benchmarks.data import DatasetFiles
from benchmarks.measure import Result


@dataclass(frozen=True)
class RunInfo:
    """Facts about the run that are not measurements (kept in the JSON, to render it again)."""

    argv: list[str]
    started: str
    wall_s: float
    load_start: list[float]
    load_end: list[float]
    generated_s: float | None
    facts: dict[str, str]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    try:  # a source checkout that is not installed
        module = __import__(dist)
    except ImportError:
        return "not importable"
    return str(getattr(module, "__version__", "source tree"))


_FIRST_TOUCH = """
import time, numpy as np
t = time.perf_counter(); a = np.ones(2**29, np.uint8); first = time.perf_counter() - t
t = time.perf_counter(); a[:] = 2; again = time.perf_counter() - t
print(f"{0.5 / first:.2f} GiB/s first touch, {0.5 / again:.1f} GiB/s after")
"""


def first_touch() -> str:
    """How fast a fresh process can fault in 512 MiB (slow on VMs that return free memory)."""
    out = subprocess.run(
        [sys.executable, "-c", _FIRST_TOUCH], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or out.stderr.strip()[-200:]


def _git_head() -> str:
    """The checkout's commit, marked when the library's files differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, check=False)
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or "no commit"
        dirty = git("status", "--porcelain", "--", "asynchdf5")
    except OSError:
        return "unknown"
    return f"{head} + uncommitted changes" if dirty else head


def collect_facts() -> dict[str, str]:
    """The machine and the software versions, taken when the run starts."""
    vm = psutil.virtual_memory()
    return {
        "CPU": f"{_cpu_model()}, {os.cpu_count()} logical cores",
        "RAM": f"{vm.total / 2**30:.1f} GiB",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "numpy / h5py / HDF5": (
            f"{np.__version__} / {h5py.version.version} / {h5py.version.hdf5_version}"
        ),
        "torch": _version("torch"),
        "asynchdf5": f"{_version('asynchdf5')} (git {_git_head()})",
        "memory, fresh process writing 512 MiB": first_touch(),
    }


def machine(info: RunInfo) -> list[str]:
    """The machine and software description, as markdown lines."""
    generated = f" (of which data generation {info.generated_s:.0f} s)" if info.generated_s else ""
    rows = [
        ("date (UTC)", info.started),
        ("command", f"`{shlex.join(['python', '-m', 'benchmarks', *info.argv])}`"),
        *info.facts.items(),
        ("load average (1/5/15 min) at start", " / ".join(f"{x:.2f}" for x in info.load_start)),
        ("load average at end", " / ".join(f"{x:.2f}" for x in info.load_end)),
        ("suite wall time", f"{info.wall_s / 60:.1f} min{generated}"),
    ]
    return _table(["", ""], rows)


def save_json(
    path: Path, info: RunInfo, all_files: Sequence[DatasetFiles], results: Sequence[Result]
) -> None:
    """Everything the report is made of, for ``--render``."""
    doc = {
        "info": dataclasses.asdict(info),
        "files": [f.to_json() for f in all_files],
        "results": [r.to_json() for r in results],
    }
    path.write_text(json.dumps(doc, indent=1))


def load_json(path: Path) -> tuple[RunInfo, list[DatasetFiles], list[Result]]:
    """Inverse of :func:`save_json`."""
    doc = json.loads(path.read_text())
    return (
        RunInfo(**doc["info"]),
        [DatasetFiles.from_json(f) for f in doc["files"]],
        [Result.from_json(r) for r in doc["results"]],
    )


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _rate(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.0f}"


def _secs(x: float | None) -> str:
    if x is None:
        return "—"
    if x < 0.1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s" if x < 100 else f"{x:.0f} s"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "—"
    return f"{a / b:.2f}"


def _mib(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _on_disk(files: DatasetFiles) -> int:
    return sum(p.stat().st_size for p in files.paths if p.exists())


def datasets(all_files: Sequence[DatasetFiles]) -> list[str]:
    """Data set table."""
    rows = []
    for f in all_files:
        s = f.spec
        disk = _on_disk(f)
        rows.append(
            (
                f"`{s.name}`",
                s.title,
                f"{s.samples:,}",
                f"{s.total_bytes / 1e9:.2f}",
                f"{disk / 1e9:.2f} ({disk / s.total_bytes:.0%})",
                f"`{f.source}`",
            )
        )
    return _table(["set", "what", "samples", "GB (uncompressed)", "GB on disk", "source"], rows)


def _by_label(results: Sequence[Result], files: DatasetFiles) -> dict[str, Result]:
    return {r.label: r for r in results if r.job["files"]["spec"]["name"] == files.spec.name}


def _sps(r: Result | None) -> float | None:
    return r.outcome.samples_per_s if r is not None and r.outcome is not None else None


RAW_WARM = "raw preadv, 64 MiB buffer, warm"
RAW_COLD = "raw preadv, 64 MiB buffer, cold"
IN_RAM = "in-RAM ceiling (np.take)"
SLAB = "h5py slabs dset[i:i+65536], in order"
FANCY = "h5py sorted fancy index per batch"


def _in_ram(
    results: Sequence[Result], files: DatasetFiles, all_files: Sequence[DatasetFiles]
) -> Result | None:
    """The in-RAM ceiling of this set, or of the set with the same samples in another layout."""
    for other in [files, *all_files]:
        if other.spec.kind == files.spec.kind and other.spec.samples == files.spec.samples:
            found = _by_label(results, other).get(IN_RAM)
            if found is not None:
                return found
    return None


def results_table(results: Sequence[Result], files: DatasetFiles) -> list[str]:
    """Every measurement of one data set (probes and decompression have their own tables)."""
    spec = files.spec
    mine = [
        r
        for r in _by_label(results, files).values()
        if r.job["params"].get("group") not in ("probe", "decompress")
    ]
    raw_warm = _sps(_by_label(results, files).get(RAW_WARM))
    rows = []
    for r in mine:
        o = r.outcome
        notes = []
        if r.error:
            notes.append(r.error.replace("|", "/"))
        if o is not None:
            if o.extrapolated:
                notes.append(f"extrapolated from {o.timed_samples:,} samples")
            if o.bytes_per_s is not None and spec.layout == "gzip":
                notes.append(f"reads {o.bytes_per_s / 1e6:,.0f} MB/s of stored (compressed) bytes")
            if "load_s" in o.extra:
                notes.append(f"load into RAM {o.extra['load_s']:.1f} s, not counted")
            for i, later in enumerate(o.extra.get("later_epochs", []), start=2):
                notes.append(
                    f"epoch {i}: {_rate(later['samples_per_s'])} samples/s "
                    f"({_secs(later['epoch_s'])})"
                )
        mbs = None if o is None else o.samples_per_s * spec.sample_bytes / 1e6
        rows.append(
            (
                r.label,
                _rate(_sps(r)) + ("*" if o is not None and o.extrapolated else ""),
                "—" if mbs is None else f"{mbs:,.0f}",
                _secs(o.first_batch_s if o else None),
                _secs(o.epoch_s if o else None),
                _ratio(_sps(r), raw_warm),
                f"{_mib(r.peak_rss_mib)} ({_mib(r.start_rss_mib)})",
                _mib(r.children_peak_rss_mib),
                "—" if r.load_before is None else f"{r.load_before:.1f}",
                "; ".join(notes),
            )
        )
    return _table(
        [
            "loader",
            "samples/s",
            "MB/s",
            "first batch",
            "epoch",
            "÷ raw warm",
            "peak RSS MiB (at start)",
            "workers RSS MiB",
            "load",
            "notes",
        ],
        rows,
    )


def decompress_table(results: Sequence[Result], files: DatasetFiles) -> list[str]:
    """Decompression limit of a gzip set, per codec and thread count."""
    mine = [
        r
        for r in _by_label(results, files).values()
        if r.job["params"].get("group") == "decompress"
    ]
    if not mine:
        return []
    one = {r.job["params"]["codec"]: r for r in mine if r.job["params"]["threads"] == 1}
    rows = []
    for r in mine:
        p, o = r.job["params"], r.outcome
        base = one.get(p["codec"])
        rows.append(
            (
                p["codec"],
                p["threads"],
                "—" if o is None or o.bytes_per_s is None else f"{o.bytes_per_s / 1e6:,.0f}",
                _rate(_sps(r)),
                _ratio(_sps(r), _sps(base)),
                r.error
                or (f"{o.extra['chunks']} chunks, stored/raw {o.extra['ratio']:.2f}" if o else ""),
            )
        )
    return _table(
        ["codec", "threads", "MB/s out", "samples/s (data top)", "× 1 thread", "notes"], rows
    )


def ratios_table(results: Sequence[Result], all_files: Sequence[DatasetFiles]) -> list[str]:
    """asynchdf5 against each reference, per data set and asynchdf5 run, from the same run."""
    rows = []
    for files in all_files:
        by = _by_label(results, files)
        loaders = [_sps(v) for v in by.values() if v.job["params"].get("group") == "torch"]
        best_loader = max((v for v in loaders if v is not None), default=None)
        dec = [_sps(r) for r in by.values() if r.job["params"].get("group") == "decompress"]
        best_dec = max((d for d in dec if d is not None), default=None)
        in_ram = _sps(_in_ram(results, files, all_files))
        for label, r in by.items():
            if r.job["params"].get("group") != "asynchdf5" or r.outcome is None:
                continue
            raw = _sps(by.get(RAW_COLD if r.cold else RAW_WARM))
            epochs = [r.outcome.samples_per_s] + [
                float(e["samples_per_s"]) for e in r.outcome.extra.get("later_epochs", [])
            ]
            for i, ours in enumerate(epochs, start=1):
                rows.append(
                    (
                        f"`{files.spec.name}`",
                        f"{label.removeprefix('asynchdf5 ')}, epoch {i}",
                        _rate(ours),
                        _ratio(ours, raw),
                        _ratio(ours, best_dec),
                        _ratio(ours, in_ram),
                        _ratio(ours, _sps(by.get(SLAB))),
                        _ratio(ours, _sps(by.get(FANCY))),
                        _ratio(ours, best_loader),
                    )
                )
    if not rows:
        return ["asynchdf5 was not measured in this run (not importable, or left out with --only)."]
    return _table(
        [
            "set",
            "asynchdf5 run",
            "samples/s",
            "÷ raw read, same cache state",
            "÷ best decompress",
            "÷ in-RAM",
            "÷ h5py slabs",
            "÷ h5py fancy",
            "÷ best DataLoader",
        ],
        rows,
    )


def probe_table(results: Sequence[Result]) -> list[str]:
    """Event-loop gaps of the stall probe."""
    rows = []
    for r in results:
        if r.job["params"].get("group") != "probe":
            continue
        p, o = r.job["params"], r.outcome
        name = r.job["files"]["spec"]["name"]
        if o is None:
            rows.append(
                (f"`{name}`", p["loader"], p["tick"], "—", "—", "—", "—", "—", "—", r.error)
            )
            continue
        idle, busy = o.extra.get("idle", {}), o.extra.get("busy", {})
        rows.append(
            (
                f"`{name}`",
                p["loader"],
                p["tick"],
                _rate(o.samples_per_s) + ("*" if o.extrapolated else ""),
                f"{idle.get('p99_ms', float('nan')):.2f} / {idle.get('max_ms', float('nan')):.1f}"
                f" / {idle.get('stalled_ms_per_s', float('nan')):.0f}",
                f"{busy.get('p50_ms', float('nan')):.2f}",
                f"{busy.get('p99_ms', float('nan')):.2f}",
                f"{busy.get('max_ms', float('nan')):.1f}",
                f"{busy.get('stalled_ms_per_s', float('nan')):.0f}",
                f"{int(busy.get('ticks', 0)):,} ticks; longest gap began "
                f"{busy.get('max_at_s', float('nan')):.2f} s in",
            )
        )
    if not rows:
        return []
    return _table(
        [
            "set",
            "loader",
            "tick",
            "samples/s",
            "idle p99 / max ms / stalled",
            "busy p50 ms",
            "busy p99 ms",
            "busy max ms",
            "stalled ms per s",
            "notes",
        ],
        rows,
    )


HOW_TO_READ = """\
How to read this:

- Every row is one shuffled epoch (batch 256) in its own subprocess, except "h5py slabs" (in order,
  no shuffle) and the raw reads (the stored bytes in file order). `*` marks rates extrapolated from
  a time-bounded run (warm-up batches left out); the slow loaders are bounded so the suite stays
  short.
- samples/s is over the epoch including the first batch; MB/s is samples/s times the uncompressed
  sample size (data + int64 label), so it is comparable across layouts. For the raw reads it is the
  equivalent: the whole stored set per epoch time (for gzip the stored bytes are compressed; the
  note gives the real read rate).
- first batch: from the start (nothing open) to the first batch in hand. For the in-RAM ceiling the
  load into RAM is not counted.
- "raw preadv" is the read limit of the same bytes: one thread, `os.preadv` into one reused buffer,
  best of three passes when warm. The 4 MiB buffer stays in the CPU cache, the 64 MiB one does
  not; a loader writes its samples to DRAM, so the 64 MiB rate is the limit that counts.
- warm and cold: before every warm measurement the files are read once, untimed (a VM may page
  out cache that was not touched for a while); cold ones drop the files from the page cache first
  (`posix_fadvise(DONTNEED)`), though on a VM the host may still cache the disk.
- "decompress only" is the gzip limit: the stored data chunks decompressed from memory in a thread
  pool (no I/O); the threads only help where the codec releases the GIL.
- peak RSS is the measurement process's own peak (`VmHWM`), with its RSS once the harness was
  imported in brackets; workers RSS is the sampled peak of the DataLoader workers' summed RSS
  (forked pages shared with the parent are counted once per process).
- "memory, fresh process writing 512 MiB": on some VMs the first write to memory the guest has
  returned to the host is an order of magnitude slower than later writes; every loader that
  allocates its buffers per run pays it, so it is reported with the machine.
- load is the 1-minute load average when the measurement started (2 cores: above ~0.5 something
  else was running).
- Stall probe: a coroutine sleeps 1 ms in a loop beside the consumer and records the gaps between
  wake-ups; "h5py tick" also reads an attribute of another small HDF5 file on every tick, which
  waits whenever some thread holds h5py's global lock. "naive" is `await to_thread.run_sync(h5py
  read_direct)` of 65,536-row slabs, shown as a reference of what the probe catches. The idle
  columns are the same ticker before the loader starts: the floor set by the machine's load.
  "stalled ms per s" is the time spent in gaps over 5 ms per second of the run.
"""


def render(results: Sequence[Result], all_files: Sequence[DatasetFiles], info: RunInfo) -> str:
    """The whole report."""
    out = [
        "# asynchdf5 benchmarks",
        "",
        *machine(info),
        "",
        "## Data sets",
        "",
        *datasets(all_files),
        "",
        "## asynchdf5 against the limits and the alternatives",
        "",
        "Ratios of samples/s measured in this run (above 1: asynchdf5 is faster). Epoch 1 is "
        "timed from the layer's construction (files opened, buffers allocated); epoch 2 of the "
        "same layer from its `async for`. With the default chunk size the whole image set is one "
        "chunk, so its epoch 2 is served from memory; the runs with the smaller chunk size "
        "stream every epoch through the cache, as a set larger than memory must.",
        "",
        *ratios_table(results, all_files),
        "",
    ]
    for files in all_files:
        if not _by_label(results, files):
            continue
        out += [
            f"## `{files.spec.name}`: {files.spec.title}",
            "",
            *results_table(results, files),
            "",
        ]
        dec = decompress_table(results, files)
        if dec:
            out += ["Decompression limit (stored gzip chunks of `data`, in memory):", "", *dec, ""]
    probes = probe_table(results)
    if probes:
        out += ["## Event-loop stall probe", "", *probes, ""]
    out += ["## Notes", "", HOW_TO_READ]
    return "\n".join(out)


BEGIN, END = "<!-- suite report: begin -->\n", "<!-- suite report: end -->\n"


def write(text: str, path: Path) -> None:
    """Put the report between the markers of ``path`` (at its top if it has none): the sections
    written by hand after them (targets, other benchmarks' figures) stay as they are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    block = BEGIN + text.rstrip("\n") + "\n" + END
    if BEGIN in old and END in old:
        head, _, rest = old.partition(BEGIN)
        _, _, tail = rest.partition(END)
        new = head + block + tail
    else:
        new = block + ("\n" + old if old else "")
    path.write_text(new)
    print(f"# report written to {path}", file=sys.stderr)
