"""Reading a file's bytes into a buffer until it is full: one ``preadv`` may return fewer
bytes than asked (a signal, a pipe, a file that ends), so every reader of whole ranges loops.

Below every layer that reads files (the sources, the helper process's wire, the command line),
each of which says in its own words what a range that ends early means.
"""

from __future__ import annotations

import os

__all__ = ["pread_into"]


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes of ``fd`` from ``offset`` into ``view`` (a writable byte view),
    calling ``os.preadv`` until the view is full or the file ends (blocking).

    Returns
    -------
    int
        The bytes read: ``len(view)``, or fewer where the file ends first. An ``OSError`` of
        the read propagates (``EINTR`` is retried by Python itself).
    """
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done
