"""One file's pages in the page cache: evict them, and count those still resident.

Only the benchmark's own file is evicted (``posix_fadvise(DONTNEED)``), never the whole cache:
other processes on the machine may be measuring. The residency check maps the file and asks
``mincore``, which faults nothing in; libc is loaded by name, without
``ctypes.util.find_library`` (which runs ``ldconfig`` or a compiler in a subprocess).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np


def evict(path: str | Path) -> None:
    """Drop the file's clean pages from the page cache (flushing dirty ones first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str | Path, buffer_bytes: int = 64 << 20) -> None:
    """Read the file (or every file under the folder ``path``) once, so that its pages are in
    the page cache."""
    path = Path(path)
    buf = memoryview(bytearray(buffer_bytes))
    for p in [path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file()):
        with p.open("rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _libc() -> ctypes.CDLL | None:
    for name in ("libc.so.6", None):
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
        except (OSError, AttributeError):
            continue
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    return None


def resident_fraction(path: str | Path) -> float | None:
    """The share of the file's pages in the page cache (``mincore``), or None if unavailable."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None or size == 0:
        return None
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return float((np.frombuffer(memoryview(vec), np.uint8) & 1).sum()) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
