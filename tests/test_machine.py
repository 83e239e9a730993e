"""The memory this process may use: the physical memory, or a smaller cgroup limit (v2 and v1),
read from a ``/proc`` and ``/sys`` laid out in a temporary folder as the kernel lays them out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asynchdf5._machine import memory_bytes

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
V1_NO_LIMIT = "9223372036854771712"


def layout(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("cgroup", "files", "expected"),
    [
        # v2: the process's group limits it ...
        ("0::/job/step\n", {"job/step/memory.max": "1073741824", "job/memory.max": "max"}, 2**30),
        # ... and so does a group above it.
        ("0::/job/step\n", {"job/step/memory.max": "max", "job/memory.max": "536870912"}, 2**29),
        # Inside a container, its own group is the root of what it sees.
        ("0::/\n", {"memory.max": "805306368"}, 3 * 2**28),
        # v1: the memory controller's hierarchy; "no limit" is a huge number.
        (
            "4:memory:/docker/abc\n3:cpu:/docker/abc\n",
            {
                "memory/docker/abc/memory.limit_in_bytes": V1_NO_LIMIT,
                "memory/memory.limit_in_bytes": "2147483648",
            },
            2**31,
        ),
        # No limit anywhere: the physical memory.
        ("0::/job\n", {"job/memory.max": "max"}, PHYSICAL),
        ("4:memory:/x\n", {"memory/x/memory.limit_in_bytes": V1_NO_LIMIT}, PHYSICAL),
        ("0::/job\n", {}, PHYSICAL),  # no cgroup file system mounted
    ],
)
def test_the_smallest_limit_counts(
    tmp_path: Path, cgroup: str, files: dict[str, str], expected: int
) -> None:
    assert memory_bytes(layout(tmp_path, cgroup, files)) == min(expected, PHYSICAL)


def test_a_limit_above_the_physical_memory_does_not_count(tmp_path: Path) -> None:
    root = layout(tmp_path, "0::/\n", {"memory.max": str(4 * PHYSICAL)})
    assert memory_bytes(root) == PHYSICAL


def test_no_proc(tmp_path: Path) -> None:
    assert memory_bytes(tmp_path) == PHYSICAL


def test_lines_it_does_not_know_are_skipped(tmp_path: Path) -> None:
    cgroup = "garbage\n5:memory:relative/path\n1:name=systemd:/x\n0::/job\n"
    root = layout(tmp_path, cgroup, {"job/memory.max": "1073741824", "memory.max": "oops"})
    assert memory_bytes(root) == min(2**30, PHYSICAL)


def test_v2_beside_v1_hierarchies_is_found_where_it_is_mounted(tmp_path: Path) -> None:
    # Hybrid: v1 controllers under /sys/fs/cgroup, the v2 hierarchy at /sys/fs/cgroup/unified.
    root = layout(tmp_path, "4:cpu:/x\n0::/job\n", {"unified/job/memory.max": "1073741824"})
    assert memory_bytes(root) == min(2**30, PHYSICAL)


def test_names_and_numbers_the_kernel_does_not_write_never_raise(tmp_path: Path) -> None:
    # A group's name may be any bytes; a path with two leading slashes; digits of other scripts.
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_bytes(b"0::/job/\xe9t\xe9\n0:://two\n")
    named = tmp_path.joinpath("sys/fs/cgroup/job", b"\xe9t\xe9".decode(errors="surrogateescape"))
    named.mkdir(parents=True)
    (named / "memory.max").write_text("536870912\n")
    (tmp_path / "sys/fs/cgroup/two").mkdir()
    (tmp_path / "sys/fs/cgroup/two/memory.max").write_text("\u00b2\n")  # superscript two
    assert memory_bytes(tmp_path) == min(2**29, PHYSICAL)


@pytest.mark.parametrize(
    "name", ["a\x1cb", "a\x1db", "a\x0bb", "a\x0cb", "a\x85b", "a\u2028b", "a\rb", "sp ace "]
)
def test_a_group_whose_name_holds_what_splitlines_or_strip_would_cut_is_found(
    tmp_path: Path, name: str
) -> None:
    # Review 14, D3: these names were cut short, so the group's own limit was missed and the
    # machine's memory came back.
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_bytes(f"0::/{name}\n".encode())
    group = tmp_path / "sys/fs/cgroup" / name
    group.mkdir(parents=True)
    (group / "memory.max").write_text(f"{2**30}\n")
    assert memory_bytes(tmp_path) == min(2**30, PHYSICAL)


def test_the_memory_defaults_take_their_share_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a container limited to 3 GiB: a cache of 1 GiB, data sets of up to 1.5 GiB stay mapped.
    import asynchdf5._cache as cache
    import asynchdf5._read._mapped as mapped

    for module in (cache, mapped):
        monkeypatch.setattr(module, "memory_bytes", lambda: 3 * 2**30)
    assert cache.default_cache_bytes() == 2**30
    assert mapped.default_keep_bytes() == 3 * 2**29
