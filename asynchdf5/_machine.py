"""What memory this process may use: the machine's, or less where a cgroup limits it; and how
much of it is still free for the layer (its room).

The defaults that scale with memory (the cache budget, how large a mapped data set may be and
stay mapped) take a share of this. In a container the machine's physical memory is the host's;
the container's limit is its cgroup's ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1),
and going past it gets the process killed, so the smaller one counts. A training process holds
memory of its own (a model, an optimizer) when it opens a layer: :func:`memory_room` takes what
is held under each limit off it (a cgroup's anonymous memory, or this process's), so that a
default sized from the room leaves the process's own memory, and more, where it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryRoom", "memory_bytes", "memory_room"]


def _physical() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0


def memory_bytes(root: Path = Path("/")) -> int:
    """The physical memory, or the memory limit of this process's cgroups where smaller
    (0 where neither is known). ``root``: where ``/proc`` and ``/sys`` are (for tests)."""
    physical = _physical()
    limits = [n for n, _, _ in _cgroup_limits(root) if n > 0]
    if physical and limits:
        return min(physical, *limits)
    return physical or min(limits, default=0)


@dataclass(frozen=True)
class MemoryRoom:
    """The limit with the least room left under it: ``limit`` bytes, ``held`` of them held now
    (anonymous memory: what the kernel cannot drop to make room), and what sets it, in words."""

    limit: int
    held: int
    what: str

    @property
    def free(self) -> int:
        return max(0, self.limit - self.held)

    def __str__(self) -> str:
        return (
            f"{self.what} ({self.limit / 2**20:.0f} MiB, {self.held / 2**20:.0f} MiB of it "
            "held already)"
        )


def memory_room(root: Path = Path("/")) -> MemoryRoom | None:
    """The limit with the least room left under it: each cgroup limit of this process (what its
    group holds: ``anon`` of v2's ``memory.stat``, ``total_rss`` of v1's), and the physical
    memory (what this process holds: ``RssAnon``); None where no limit is known."""
    found = []
    physical = _physical()
    if physical:
        found.append(MemoryRoom(physical, _own_anonymous(root), "the machine's memory"))
    for limit, group, version in _cgroup_limits(root):
        key = "anon" if version == 2 else "total_rss"
        held = _stat(group / "memory.stat", key)
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        where = group.relative_to(root / "sys/fs/cgroup")
        what = f"the cgroup limit {where}/{name}"
        found.append(MemoryRoom(limit, held if held is not None else 0, what))
    return min(found, key=lambda r: r.free, default=None)


def _own_anonymous(root: Path) -> int:
    """This process's anonymous resident memory (0 where unknown)."""
    held = _stat(root / "proc/self/status", "RssAnon:")
    return 1024 * held if held is not None else 0


def _stat(path: Path, key: str) -> int | None:
    """The number after ``key`` on its line of ``path`` (``key value``), or None."""
    try:
        lines = path.read_text().split("\n")
    except (OSError, ValueError):
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == key and parts[1].isascii() and parts[1].isdigit():
            return int(parts[1])
    return None


def _cgroup_limits(root: Path) -> list[tuple[int, Path, int]]:
    """The memory limits of this process's cgroup and its ancestors (v2 and v1), as set: each
    limit, its group's folder and the cgroup version."""
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
            name, version = "memory.max", 2
        elif "memory" in controllers.split(","):
            bases, name = [root / "sys/fs/cgroup/memory"], "memory.limit_in_bytes"
            version = 1
        else:
            continue
        # The process's group and each group above it limit it; inside a container the path
        # may name the host's hierarchy, where the container sees its own group at the root.
        here = Path(path or "/")
        if not here.is_absolute():  # not a group's path (nothing else is written there)
            continue
        for group in (here, *here.parents):
            for base in bases:
                folder = base / str(group).lstrip("/")
                value = _read_limit(folder / name)
                if value is not None:
                    out.append((value, folder, version))
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
