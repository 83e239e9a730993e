"""Memory pages: giving a closed layer's cache back to the system, and ``madvise``, ``mmap`` and
``munmap`` through ctypes.

Below the cache (``_cache``) and the readers (``_read``), which both use it: the streaming slots
are the cache's, the resident arrays (a data set read once) the reader's.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable, Iterable

import numpy as np

__all__ = ["MAP_FAILED", "free_arrays", "libc_madvise", "libc_mmap", "populate"]

#: How :func:`free_arrays` gives pages back (``None`` where the platform has no such advice).
_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)

#: What :func:`libc_mmap`'s ``mmap`` answers when it fails (it may answer None too).
MAP_FAILED = ctypes.c_void_p(-1).value


def free_arrays(arrays: Iterable[np.ndarray]) -> None:
    """Give the pages of cache arrays back to the system now (``MADV_DONTNEED``).

    A layer does this in a worker thread when it closes, for two reasons. Freeing hundreds of
    MiB of touched pages keeps the thread that does it busy for tens of milliseconds: the event
    loop's thread must not wait for
    it, and ``madvise`` through ctypes releases the GIL meanwhile (``mmap.mmap.madvise`` does
    not). And the arrays may outlive the close: on asyncio the tracebacks of the pipeline's
    cancelled tasks keep views of them in reference cycles until the garbage collector runs, so
    dropping the layer's own references would not free the memory. Nothing reads the cache
    after the close (its threads are joined), so its contents may go; the mapping itself goes
    with its last reference, cheaply, as it has no pages left. Arrays not on an anonymous
    ``mmap.mmap`` (as :func:`~._cache.allocate_slots` makes them) are left alone.
    """
    madvise = libc_madvise()
    if madvise is None or _DONTNEED is None:
        return
    for a in arrays:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        m = root.base.obj if isinstance(root.base, memoryview) else None
        if isinstance(m, mmap.mmap) and not m.closed and root.nbytes:
            madvise(root.__array_interface__["data"][0], root.nbytes, _DONTNEED)


#: ``MADV_POPULATE_WRITE`` (Linux 5.14): fault a range's pages in, writable, in one call.
_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def populate(buffer: memoryview) -> None:
    """Fault in the pages of ``buffer`` (writable, never written yet) in one call, before a read
    writes them: written one fault at a time, fresh pages cost more than the read itself on some
    VMs (figures in docs/design-notes.md). Only for fresh memory: on pages already there it still
    walks them.
    Advice only: where the kernel or the platform has none, nothing happens."""
    madvise = libc_madvise()
    if madvise is None or not buffer.nbytes or buffer.readonly:
        return
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    start = address - address % _PAGE  # the page the buffer starts in is written too
    madvise(start, address + buffer.nbytes - start, _POPULATE_WRITE)


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise(address, length, advice)`` through ctypes, which releases the
    GIL (``mmap.mmap.madvise`` does not); errors in ``ctypes.get_errno()``. None where the C
    library has none. Shared with the mapped reader (``_read._mapped``)."""
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


@functools.cache
def libc_mmap() -> tuple[Callable[..., int | None], Callable[[int, int], int]]:
    """The C library's ``mmap(address, length, prot, flags, fd, offset)`` (64-bit offsets; a
    failure answers None or :data:`MAP_FAILED`, its error in ``ctypes.get_errno()``) and
    ``munmap(address, length)`` through ctypes. Unlike :class:`mmap.mmap` (before Python 3.13),
    a mapping made this way keeps no duplicate of the descriptor. Shared by the mapped reader
    (``_read._maps``) and the helper process's batch slots (``_process._wire``); OSError or
    AttributeError where the C library cannot be loaded or has no ``mmap``."""
    libc = ctypes.CDLL(None, use_errno=True)
    map_ = libc.mmap
    map_.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int64,
    ]
    map_.restype = ctypes.c_void_p
    unmap = libc.munmap
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    unmap.restype = ctypes.c_int
    return map_, unmap
