"""A read lease on a mapped file: while the layer holds it, a truncation of the file waits for it.

Mapped (``mmap=True``, or ``"auto"``, which maps only with a lease), the gather reads rows
straight from the file's pages. A page past the end of a
file truncated under the mapping is a ``SIGBUS`` when touched, which ends the process. A read
lease (Linux, ``fcntl(F_SETLEASE, F_RDLCK)``) closes that hole for the common cause, another
program rewriting or truncating the file: the kernel makes every ``open`` for writing and every
``truncate(2)`` of the file wait until the lease is given back, or for
``/proc/sys/fs/lease-break-time`` seconds (45 by default), and marks the lease as being broken
meanwhile. A thread of the layer looks at the lease every :data:`POLL_S` seconds, and each top's
copy asks the kernel right before it. Once it is being broken, no gather may start from the
mapping; when the gathers in flight are done, the
lease is given back and the writer goes on, and the layer's next gather is a
:class:`~asynchdf5.ReadError`. Every row gathered before that was read while nobody could write
the file.

The kernel tells a lease's holder that it is being broken with a signal, ``SIGIO`` unless told
otherwise, which ends a process that does not handle it. The layer asks for none: the signal is
set to ``SIGURG`` (ignored unless handled) before the lease is taken, and the lease's owner to
none right after, so no signal is sent at all.

A lease is granted only to the file's owner (or a process with ``CAP_LEASE``), on a file system
that grants leases (not NFS), while nobody has the file open for writing. Otherwise
:meth:`Lease.take` says why, and ``mmap="auto"`` copies the file while ``mmap=True`` maps it
without one. What a lease cannot cover (found
by review, shown in ``/tmp`` scripts, not in the tests):

- ``open(O_RDONLY | O_TRUNC)`` by a user allowed to write the file: Linux truncates it without
  looking at leases;
- a writer in this same process that holds the GIL while the kernel makes it wait (h5py opening
  the file for writing): the lease's thread cannot run to give it back, so the whole process
  stands still for the lease-break time, the kernel then gives the lease up, and a gather that
  had already passed its check when the writer took the GIL meets the truncated file;
- a file system that grants a lease of this machine only (FUSE, network file systems that fall
  back to local leases): writes from other machines do not break it (``mmap="auto"`` maps only
  files on file systems known to be local: :mod:`._choice`);
- a disk error when a page dropped from memory is read again during a gather, and a gather that
  lasts longer than the lease-break time (a process stopped in the middle of one).

Each is a ``SIGBUS``, as without a lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import threading
import weakref
from types import TracebackType

from .._errors import ReadError
from .._sources._local import LocalFile

__all__ = ["POLL_S", "Lease", "Leases"]

#: How often the lease is looked at: the longest a writer waits for a layer that is not gathering.
POLL_S = 0.05
#: The shortest lease-break time a lease is taken with: the kernel gives a lease up after it, so
#: a shorter one would leave a gather in flight unguarded.
MIN_BREAK_S = 5

_BREAK_TIME = "/proc/sys/fs/lease-break-time"


class Lease:
    """A read lease on ``file``, and the gathers from its mapping (``with lease:`` around each).

    Use :meth:`take`; :meth:`close` gives it back and joins its thread."""

    def __init__(self, file: LocalFile, fd: int) -> None:
        self.file = file
        self._fd = fd
        self._lock = threading.Lock()
        self._active = 0  # gathers in flight
        self._broken = False  # being broken: no gather may start
        self._held = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asynchdf5-lease", daemon=True)
        self._thread.start()

    @classmethod
    def take(cls, file: LocalFile) -> Lease | str:
        """A lease on ``file``, or why none can be taken."""
        try:
            with open(_BREAK_TIME) as f:
                break_s = int(f.read())
        except (OSError, ValueError) as exc:
            return f"cannot read {_BREAK_TIME}: {exc}"
        if break_s < MIN_BREAK_S:
            return f"the lease-break time is {break_s} s ({_BREAK_TIME}), under {MIN_BREAK_S}"
        try:  # the file the source has open, even if renamed or replaced since
            fd = os.open(f"/proc/self/fd/{file.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"cannot open the file again to lease it: {exc.strerror}"
        try:
            fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
        except OSError as exc:
            os.close(fd)  # gives back a lease taken
            return _refused(exc)
        # A change between the source's opening and the lease is seen by the fingerprint check
        # of the first chunk made ready (``MappedReader._prepare``), before any gather.
        try:
            lease = cls(file, fd)
        except BaseException:
            os.close(fd)
            raise
        _live.add(lease)
        return lease

    @property
    def broken(self) -> bool:
        with self._lock:
            return self._broken

    def error(self) -> ReadError:
        """The error of a gather after the lease was broken: the file's change if it shows."""
        try:
            self.file.check()
        except ReadError as exc:
            return exc
        return ReadError(
            f"{self.file.name}: a program (this one or another) opened the file for writing or "
            "truncated it while it was mapped; it waited for the gathers in flight, and "
            "no row was gathered after it"
        )

    def __enter__(self) -> None:
        with self._lock:
            # The kernel's word, not only the last poll's: a lease it gave up while this
            # process could not run (stopped, or its lease thread kept from the GIL by a writer
            # of this process) is seen before the gather, not after.
            if not self._broken and self._state() == fcntl.F_RDLCK:
                self._active += 1
                return
            self._break()
        raise self.error()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            self._active -= 1
            if self._broken and self._active == 0:
                self._give_back()

    def _state(self) -> int:
        """The lease as the kernel has it: ``F_RDLCK`` while held and not being broken."""
        if self._fd < 0:
            return fcntl.F_UNLCK
        try:
            return int(fcntl.fcntl(self._fd, fcntl.F_GETLEASE))
        except OSError:
            return fcntl.F_UNLCK

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._state() != fcntl.F_RDLCK:
                with self._lock:
                    self._break()
                return

    def _break(self) -> None:
        """Under the lock: no gather may start now; the lease goes back once none is in flight
        (here, or when the last one ends)."""
        self._broken = True
        if self._active == 0:
            self._give_back()

    def _give_back(self) -> None:
        """Under the lock, no gather in flight: let the writer go on."""
        if self._held:
            self._held = False
            with contextlib.suppress(OSError):  # given up by the kernel already
                fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

    def close(self) -> None:
        """Stop watching, give the lease back and close its descriptor (no gather may run).

        Given back explicitly, not by closing the descriptor: a child forked meanwhile shares
        the open file the lease is on, and closing ours would leave the lease to the child."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._broken = True
            self._give_back()
            self._close_fd()
        _live.discard(self)

    def _forked(self) -> None:
        """In a child forked from this process: the lease is the parent's (the child shares
        the open file it is on, and giving it back here would give back the parent's). The
        child's copy of the descriptor is closed, and the child gathers nothing from the file."""
        self._broken, self._held = True, False
        self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class Leases:
    """The leases of several mapped files held as one guard: a gather enters every one (it may
    take rows of any of the files), and none starts once one is being broken."""

    def __init__(self, leases: list[Lease]) -> None:
        self.leases = leases

    @property
    def broken(self) -> bool:
        return any(lease.broken for lease in self.leases)

    def error(self) -> ReadError:
        """The error of the first lease being broken (as :meth:`Lease.error`)."""
        broken = [lease for lease in self.leases if lease.broken] or self.leases
        return broken[0].error()

    def __enter__(self) -> None:
        entered: list[Lease] = []
        try:
            for lease in self.leases:
                lease.__enter__()
                entered.append(lease)
        except BaseException:
            for lease in reversed(entered):
                lease.__exit__(None, None, None)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for lease in reversed(self.leases):
            lease.__exit__(None, None, None)

    def close(self) -> None:
        for lease in self.leases:
            lease.close()


#: Leases taken and not closed, for :func:`_after_fork_in_child`.
_live: weakref.WeakSet[Lease] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lease in list(_live):
        lease._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _refused(exc: OSError) -> str:
    if exc.errno == errno.EAGAIN:
        return "the file is open for writing"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "this process does not own the file (nor has CAP_LEASE)"
    return f"its file system grants no lease ({exc.strerror})"
