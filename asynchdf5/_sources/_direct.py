"""Reads around the page cache, for data read once an epoch: ``O_DIRECT``, or advice.

Data larger than the memory a process may use gains nothing from the page cache: every page
read is evicted again before the next epoch, by the kernel's reclaim, which under a memory
limit runs in the reading thread itself and costs more than the read. A direct read moves the
bytes from the device into an aligned buffer of the thread's, then one copy puts them in place
(offsets, sizes and the buffer aligned to :data:`DIRECT_ALIGN`). Where a file system refuses
direct reads, or ``ASYNCHDF5_DIRECT=0`` is set, :func:`advise` tells the kernel what is read
next and what is done with.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

import numpy as np

from .._errors import ReadError

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_BYTES",
    "DIRECT_MIN",
    "DONTNEED",
    "WILLNEED",
    "advise",
    "open_direct",
    "read_direct",
]

#: Offsets, sizes and buffers of direct reads are aligned to this (the largest logical block
#: size in common use) ...
DIRECT_ALIGN = 4096
#: ... and move at most this many bytes each, through a buffer of each reading thread's.
DIRECT_BYTES = 4 * 2**20
#: Ranges smaller than this are read through the page cache all the same: a narrow top's rows
#: (labels) stay cached from epoch to epoch, and a direct read of a few KiB costs a round trip
#: to the device each.
DIRECT_MIN = 64 * 2**10

#: ``posix_fadvise`` advice (None where the platform has none).
WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
DONTNEED: int | None = getattr(os, "POSIX_FADV_DONTNEED", None)

#: ``ASYNCHDF5_DIRECT=0``: never read with ``O_DIRECT`` (advice only).
VARIABLE = "ASYNCHDF5_DIRECT"

_buffers = threading.local()


def advise(fd: int, offset: int, size: int, advice: int | None) -> None:
    """``posix_fadvise``, where the platform has it; advice only, so errors are ignored."""
    if advice is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, size, advice)


def open_direct(fd: int, dev: int, ino: int) -> int:
    """``fd``'s file opened again, through ``/proc/self/fd`` (so a rename cannot swap it),
    with ``O_DIRECT``; -1 where the platform or the file system refuses it, ``ASYNCHDF5_DIRECT``
    is ``0``, or the file opened is not ``(dev, ino)``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or os.environ.get(VARIABLE) == "0" or not os.path.isdir("/proc/self/fd"):
        return -1
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1
    try:
        st = os.fstat(direct)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != (dev, ino):
        os.close(direct)
        return -1
    return direct


def _buffer() -> tuple[mmap.mmap, np.ndarray]:
    found: tuple[mmap.mmap, np.ndarray] | None = getattr(_buffers, "buffer", None)
    if found is None:
        raw = mmap.mmap(-1, DIRECT_BYTES + DIRECT_ALIGN)  # page-aligned
        found = _buffers.buffer = (raw, np.frombuffer(raw, np.uint8))
    return found


def read_direct(fd: int, offset: int, size: int, into: memoryview, about: str) -> bool:
    """Read ``size`` bytes at ``offset`` of the ``O_DIRECT`` descriptor ``fd`` into ``into``.

    False, with nothing read, when the descriptor refuses the first read (``EINVAL``: an
    alignment the file system does not take); raises :class:`~asynchdf5.ReadError`, starting
    with ``about``, when a read fails or the file ends early.
    """
    raw, buf = _buffer()
    view = memoryview(raw)
    dest = np.frombuffer(into.cast("B") if into.format != "B" else into, np.uint8)
    done = 0
    while done < size:
        at = offset + done
        lead = at % DIRECT_ALIGN
        want = min(size - done, DIRECT_BYTES - lead)
        span = -(-(lead + want) // DIRECT_ALIGN) * DIRECT_ALIGN
        try:
            got = os.preadv(fd, [view[:span]], at - lead)
        except OSError as exc:
            if exc.errno == errno.EINVAL and done == 0:
                return False
            raise ReadError(f"{about}: read failed: {exc}") from exc
        n = min(want, got - lead)
        if n <= 0:
            raise ReadError(f"{about}: unexpected end of file at byte {at} (the file is truncated)")
        dest[done : done + n] = buf[lead : lead + n]
        done += n
    return True
