"""Results of the benchmarks: the recorder a benchmark writes its figures to, the machine facts,
one JSON file per benchmark run, and the markdown table generated from those files.

A benchmark never formats its own report: it calls :meth:`Recorder.figure` with a name, a value
and a unit, :meth:`Recorder.param` with the sizes it ran, :meth:`Recorder.note` with anything a
reader needs to trust the figures, and raises :class:`Skipped` with the reason when it cannot run
here. ``python -m benchmarks report FILE|DIR ...`` turns the JSON files into markdown.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The keys every result file has (the test checks them).
KEYS = (
    "benchmark",
    "command",
    "quick",
    "started",
    "wall_s",
    "machine",
    "params",
    "figures",
    "notes",
    "skipped",
    "error",
)


class Skipped(Exception):
    """Raised by a benchmark that cannot run here; the message is the recorded reason."""


class Recorder:
    """What one benchmark run found: figures with units, parameters and notes.

    Attributes
    ----------
    name
        The benchmark's registered name.
    quick
        Toy sizes (``--quick``): the run proves the code works; its figures mean little.
    data_dir
        Where data sets are generated (and reused while their parameters hold).
    """

    def __init__(self, name: str, quick: bool, data_dir: Path) -> None:
        self.name = name
        self.quick = quick
        self.data_dir = data_dir
        self.figures: list[dict[str, Any]] = []
        self.params: dict[str, Any] = {}
        self.notes: list[str] = []

    def figure(self, name: str, value: float | None, unit: str) -> None:
        """Record ``value`` (in ``unit``) as ``name``; ``None`` (not measured) is left out, and a
        non-finite or non-positive value becomes a note, so every figure is finite and positive."""
        if value is None:
            return
        if not math.isfinite(value) or value <= 0:
            self.notes.append(f"{name}: no figure ({value!r} {unit})")
            return
        self.figures.append({"name": name, "value": float(value), "unit": unit})

    def ratio(self, name: str, num: float | None, den: float | None) -> None:
        """Record ``num / den`` as a ratio (left out when either was not measured)."""
        if num is not None and den is not None:
            self.figure(name, num / den if den > 0 else math.nan, "ratio")

    def param(self, **params: Any) -> None:
        """Record the sizes and settings of the run (JSON-able values)."""
        self.params.update(params)

    def note(self, text: str) -> None:
        """Record a line a reader needs beside the figures (a fallback taken, an error)."""
        self.notes.append(text)


# --------------------------------------------------------------------------------------------
# Machine facts


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_head() -> str:
    """The checkout's commit, marked when tracked files differ from it."""

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=REPO_ROOT, check=False
        )
        return out.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD") or "no commit"
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return "unknown"
    return f"{head} + uncommitted changes" if dirty else head


def machine() -> dict[str, Any]:
    """The machine and software a run measured on (the one helper every benchmark uses)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        ram = math.nan
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": cores,
        "ram_gib": round(ram, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "git": git_head(),
        "versions": {
            d: _version(d)
            for d in ("asynchdf5", "numpy", "h5py", "anyio", "trio", "torch", "obstore", "s3fs")
        }
        | {"hdf5": _hdf5_version()},
    }


def _hdf5_version() -> str:
    try:
        import h5py
    except ImportError:
        return "not installed"
    return str(h5py.version.hdf5_version)


def utc_now() -> str:
    """The current time, UTC, to the minute."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------------------------
# JSON files


def result_doc(
    rec: Recorder,
    command: Sequence[str],
    started: str,
    wall_s: float,
    facts: dict[str, Any],
    skipped: str | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """One benchmark run as a JSON-able document (the keys of :data:`KEYS`)."""
    facts = facts | {"load_average_end": [round(x, 2) for x in os.getloadavg()]}
    return {
        "benchmark": rec.name,
        "command": list(command),
        "quick": rec.quick,
        "started": started,
        "wall_s": round(wall_s, 2),
        "machine": facts,
        "params": rec.params,
        "figures": rec.figures,
        "notes": rec.notes,
        "skipped": skipped,
        "error": error,
    }


def write(doc: dict[str, Any], out: Path) -> Path:
    """Write ``doc`` as ``out/NAME.json`` and return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{doc['benchmark']}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The result documents in these files and folders (``*.json`` in a folder)."""
    docs = []
    for p in paths:
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        docs += [json.loads(f.read_text()) for f in files]
    return docs


# --------------------------------------------------------------------------------------------
# Markdown


def _value(x: float) -> str:
    if x >= 1e6:
        return f"{x:,.0f}" if x < 1e9 else f"{x:.3g}"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _machine_line(m: dict[str, Any]) -> str:
    v = m.get("versions", {})
    load = " / ".join(f"{x:.2f}" for x in m.get("load_average", []))
    return (
        f"{m.get('cpu')}, {m.get('usable_cpus')} usable of {m.get('logical_cpus')} logical CPUs, "
        f"{m.get('ram_gib')} GiB RAM, load {load} at start; {m.get('os')}, Python "
        f"{m.get('python')}, numpy {v.get('numpy')}, h5py {v.get('h5py')} (HDF5 {v.get('hdf5')}), "
        f"torch {v.get('torch')}; git {m.get('git')}"
    )


def markdown(docs: Sequence[dict[str, Any]]) -> str:
    """One section per result document: command, machine, figures table, notes."""
    out: list[str] = []
    for d in docs:
        out += [f"## {d['benchmark']}", ""]
        out.append(f"`{' '.join(d['command'])}` ({d['started']}, {d['wall_s']:.0f} s)")
        out += ["", f"Machine: {_machine_line(d['machine'])}.", ""]
        if d.get("skipped"):
            out += [f"Skipped: {d['skipped']}", ""]
        if d.get("error"):
            out += [f"**Failed:** {d['error']}", ""]
        if d["figures"]:
            out += ["| figure | value | unit |", "|---|---|---|"]
            out += [f"| {f['name']} | {_value(f['value'])} | {f['unit']} |" for f in d["figures"]]
            out.append("")
        if d["params"]:
            params = ", ".join(f"{k}={v}" for k, v in d["params"].items())
            out += [f"Parameters: {params}.", ""]
        out += [f"- {n}" for n in d["notes"]]
        if d["notes"]:
            out.append("")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    """``python -m benchmarks report FILE|DIR ...``: the markdown of these result files."""
    if not argv:
        print("usage: python -m benchmarks report FILE|DIR ...", file=sys.stderr)
        return 2
    print(markdown(load(Path(a) for a in argv)))
    return 0
