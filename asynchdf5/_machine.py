"""What memory this process may use: the machine's, or less where a cgroup limits it.

The defaults that scale with memory (the cache budget, how large a mapped data set may be and
stay mapped) take a share of this. In a container the machine's physical memory is the host's;
the container's limit is its cgroup's ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1),
and going past it gets the process killed, so the smaller one counts.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["memory_bytes"]


def memory_bytes(root: Path = Path("/")) -> int:
    """The physical memory, or the memory limit of this process's cgroups where smaller
    (0 where neither is known). ``root``: where ``/proc`` and ``/sys`` are (for tests)."""
    try:
        physical = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        physical = 0
    limits = [n for n in _cgroup_limits(root) if n > 0]
    if physical and limits:
        return min(physical, *limits)
    return physical or min(limits, default=0)


def _cgroup_limits(root: Path) -> list[int]:
    """The memory limits of this process's cgroup and its ancestors (v2 and v1), as set."""
    try:
        # A group's name may be any bytes: kept as they are (surrogate escapes) for the paths.
        raw = (root / "proc/self/cgroup").read_bytes()
    except OSError:
        return []
    out = []
    # Lines end at "\n" only: a name may hold "\r", "\f", "\x1c", U+2028 or end in a space,
    # which str.splitlines() and str.strip() would cut it at.
    for line in raw.decode(errors="surrogateescape").split("\n"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy (beside v1 ones, mounted at "unified")
            bases = [root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"]
            name = "memory.max"
        elif "memory" in controllers.split(","):
            bases, name = [root / "sys/fs/cgroup/memory"], "memory.limit_in_bytes"
        else:
            continue
        # The process's group and each group above it limit it; inside a container the path
        # may name the host's hierarchy, where the container sees its own group at the root.
        here = Path(path or "/")
        if not here.is_absolute():  # not a group's path (nothing else is written there)
            continue
        for group in (here, *here.parents):
            for base in bases:
                value = _read_limit(base / str(group).lstrip("/") / name)
                if value is not None:
                    out.append(value)
    return out


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    if not (text.isascii() and text.isdigit()):  # "max": no limit
        return None
    value = int(text)
    # cgroup v1 reports "no limit" as the largest page-aligned 63-bit number.
    return None if value >= 2**62 else value
