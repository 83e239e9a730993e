"""A memory cgroup for one benchmark child process: made, joined, read and removed.

The out-of-core benchmark runs each reader in a child process whose memory (anonymous memory
and the page cache it fills) is capped, so that a data set a few times the cap has to stream
from the disk. cgroup v1 (``memory.limit_in_bytes``) and v2 (``memory.max``, where
``/sys/fs/cgroup/cgroup.controllers`` lists ``memory``) are both handled. Making a group needs
root (or a delegated hierarchy); where it cannot be made, :func:`make` says why and the caller
runs without one.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    """One memory cgroup made by :func:`make` (remove it with :meth:`remove`).

    Attributes
    ----------
    path
        Its directory.
    version
        1 or 2.
    limit_bytes
        The limit written to it.
    """

    path: Path
    version: int
    limit_bytes: int

    @property
    def procs(self) -> Path:
        """The file a process writes its pid to, to join the group."""
        return self.path / "cgroup.procs"

    def peak_bytes(self) -> int | None:
        """The most memory the group has held (page cache included), where the kernel says."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_int(self.path / name)

    def limit_hits(self) -> int | None:
        """How often the group reached its limit (v1 ``memory.failcnt``; v2 ``max`` events)."""
        if self.version == 1:
            return _read_int(self.path / "memory.failcnt")
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.events").read_text().splitlines():
                key, value = line.split()
                if key == "max":
                    return int(value)
        return None

    def oom_kills(self) -> int | None:
        """Processes of the group the kernel killed for memory, where it counts them."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, value = line.split()
                if key == "oom_kill":
                    return int(value)
        return None

    def remove(self, timeout_s: float = 10.0) -> None:
        """Remove the group once its processes have gone (the kernel refuses it before)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def version() -> int | None:
    """1 or 2: which hierarchy holds the memory controller here; None where none is mounted."""
    with contextlib.suppress(OSError):
        if "memory" in (V2_ROOT / "cgroup.controllers").read_text().split():
            return 2
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return 1
    return None


def make(name: str, limit_bytes: int) -> MemoryCgroup | str:
    """A new memory cgroup ``name`` at the hierarchy's root, limited to ``limit_bytes``; or, where
    one cannot be made, the reason, in words."""
    v = version()
    if v is None:
        return "no memory cgroup controller is mounted"
    root = V1_ROOT if v == 1 else V2_ROOT
    path = root / name
    try:
        path.mkdir()
    except OSError as exc:
        return f"cannot make {path}: {exc.strerror or exc}"
    group = MemoryCgroup(path, v, limit_bytes)
    limit_file = path / ("memory.limit_in_bytes" if v == 1 else "memory.max")
    try:
        limit_file.write_text(str(limit_bytes))
        if v == 2:  # no swap, so that the limit is one on memory, not memory + swap
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
    except OSError as exc:
        group.remove()
        return f"cannot set {limit_file}: {exc.strerror or exc}"
    return group


@contextlib.contextmanager
def warm_and_capped(
    name: str, limit_mib: int, note: Callable[[str], None]
) -> Iterator[list[tuple[str, MemoryCgroup | None]]]:
    """The conditions a reader runs in, each with its label: ``("warm", None)`` and, where a
    memory cgroup ``name`` can be made, ``("<limit_mib> MiB cgroup", group)`` (where it cannot,
    ``note`` is told why). The group is removed on exit."""
    made = make(name, limit_mib * 2**20)
    groups: list[tuple[str, MemoryCgroup | None]] = [("warm", None)]
    if isinstance(made, str):
        note(f"no {limit_mib} MiB cgroup: {made}")
    else:
        groups.append((f"{limit_mib} MiB cgroup", made))
    try:
        yield groups
    finally:
        if not isinstance(made, str):
            made.remove()


def join(procs: str | os.PathLike[str]) -> None:
    """Move this process (all its threads) into the group whose ``cgroup.procs`` is ``procs``.

    Memory the process already holds stays charged where it was (neither v1 by default nor v2
    move charges): what counts against the limit is what it uses from now on.
    """
    with open(procs, "w") as f:
        f.write(str(os.getpid()))


def run_child(
    module: str, job: dict[str, Any], work: Path, name: str, group: MemoryCgroup | None
) -> tuple[Any, str | None]:
    """Run ``python -m module JOB.json`` (whose ``__main__`` calls :func:`child`) on ``job``, in
    ``group`` where one is given, within ``job["timeout"]`` seconds.

    Returns the JSON the child wrote and None, or None and the tail of its output where it failed.
    """
    job = {
        **job,
        "result": str(work / f"{name}.out.json"),
        "cgroup_procs": str(group.procs) if group else None,
    }
    job_file = work / f"{name}.job.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", module, str(job_file)],
        capture_output=True,
        text=True,
        timeout=job["timeout"],
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        return None, (proc.stderr or proc.stdout)[-1500:] or f"exit {proc.returncode}"
    return json.loads(Path(job["result"]).read_text()), None


def child(job_file: str, readers: Mapping[str, Callable[[Any], Any]]) -> None:
    """The child side of :func:`run_child`: import the modules the job names in ``imports``
    (their memory stays charged where the child started: a small limit caps the reader's data,
    not its interpreter), join the job's group, run its reader, write the JSON."""
    job = json.loads(Path(job_file).read_text())
    for module in job.get("imports", ()):
        importlib.import_module(module)
    if job.get("cgroup_procs"):
        join(job["cgroup_procs"])
    Path(job["result"]).write_text(json.dumps(readers[job["reader"]](job)))
