"""The descriptors of a local source: a bounded number of files open, the rest opened again when
a read needs them.

A source of thousands of shard files cannot keep them all open (each holds our descriptor, and
h5py's while HDF5 reads it): ``ulimit -n`` is 1024 or less on many machines. So a
:class:`LocalFile` is opened when it is catalogued, and then kept open only while it is among
the :class:`OpenFiles` most recently used; the least recently used file not in use is closed to
make room. A read *pins* its file (:meth:`LocalFile.pinned`): a pinned file is never closed, so
no descriptor is closed under a read in flight.

A file opened again is checked against the fingerprint (device, inode, size, mtime, ctime) it
had when it was catalogued, from the new descriptor: a file replaced, rewritten or truncated
while it was closed is a :class:`~asynchdf5.ReadError` naming it, never other rows. (A file that
stays open is checked after every read, as before: see :mod:`._local`.)
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import resource
import threading
from collections.abc import Iterator
from typing import NamedTuple

import h5py

from .._errors import ReadError, SourceError
from ._base import E, name_entry
from ._direct import open_direct

__all__ = ["MAX_OPEN_FILES", "Fingerprint", "LocalFile", "OpenFiles", "open_limit"]

#: The most files a source keeps open at once (a fifth of ``ulimit -n`` when that is lower).
MAX_OPEN_FILES = 128

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def open_limit() -> int:
    """How many files a source keeps open: :data:`MAX_OPEN_FILES`, or a fifth of this
    process's descriptor limit when that is lower (each file may hold three descriptors: ours,
    h5py's, and an ``O_DIRECT`` one for data larger than memory; the rest of the process needs
    its own), and at least 2."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no such limit here
        return MAX_OPEN_FILES
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    return max(2, min(MAX_OPEN_FILES, soft // 5))


class Fingerprint(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    nlink: int

    @classmethod
    def of(cls, st: os.stat_result) -> Fingerprint:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)

    def change(self, now: Fingerprint) -> str | None:
        """How the file changed from this fingerprint to ``now`` (None: its bytes did not).

        The change time catches a rewrite whose size and modification time were restored (the
        change time cannot be set back). Deleting or renaming over the file moves it too, by
        changing its link count; that leaves its bytes alone, so it is not a change.
        """
        if (now.dev, now.ino) != (self.dev, self.ino):
            return "replaced"
        if now.size != self.size:
            return f"truncated or resized ({self.size} -> {now.size} bytes)"
        if now.mtime_ns != self.mtime_ns:
            return "modified"
        if now.ctime_ns != self.ctime_ns and now.nlink == self.nlink:
            return (
                "changed in place (its change time moved: rewritten with its modification time "
                "set back, or its permissions changed)"
            )
        return None


class OpenFiles:
    """The files of one source that are open now, least recently used first, at most
    ``limit`` of them (more only while more are pinned)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = open_limit() if limit is None else limit
        self.lock = threading.Lock()
        self.open: collections.OrderedDict[LocalFile, None] = collections.OrderedDict()
        self.closed = False

    def held(self) -> tuple[int, int]:
        """How many files are open, and how many of them pinned."""
        with self.lock:
            return len(self.open), sum(1 for f in self.open if f.pins)

    def make_room(self, *, everything: bool = False) -> None:
        """Close least recently used files not pinned, until one more fits (``everything``:
        every file not pinned). Blocking; the closes run outside the lock."""
        with self.lock:
            out = []
            keep = 0 if everything else self.limit - 1
            for f in list(self.open):
                if len(self.open) <= keep:
                    break
                if f.pins == 0:
                    out.append(f.detach())
        for fd, h5 in out:
            _close(fd, h5)

    def os_open(self, name: str) -> int:
        """``os.open(name)`` for reading; out of descriptors, once more after closing every file
        not pinned. Raises OSError as ``os.open`` does (add :meth:`limit_hint` to its message
        when it is EMFILE)."""
        try:
            return os.open(name, _FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        self.make_room(everything=True)
        return os.open(name, _FLAGS)

    def limit_hint(self) -> str:
        """What to say when the process has no descriptor left for one more file."""
        n, pinned = self.held()
        return (
            f" (this process may open no more files; the source holds {n} files open, "
            f"{pinned} of them in use, and keeps at most {self.limit} open: raise the limit with "
            "`ulimit -n`)"
        )

    def close(self) -> None:
        """Close every file, pinned or not (the source is closing: its reads are over); later
        pins raise."""
        with self.lock:
            self.closed = True
            out = [f.take() for f in list(self.open)]
        for fd, h5 in out:
            _close(fd, h5)


def _close(fd: int, h5: h5py.File | None) -> None:
    if h5 is not None:
        h5.close()
    if fd >= 0:
        os.close(fd)


def _out_of_descriptors(exc: OSError) -> bool:
    """Whether h5py failed to open a file because the process has no descriptor left (HDF5
    reports the errno in its message only)."""
    return exc.errno in (errno.EMFILE, errno.ENFILE) or "Too many open files" in str(exc)


class LocalFile:
    """A local file of a source, catalogued with the fingerprint it had then; open while it is
    pinned or among the source's most recently used files, opened again (and checked against
    that fingerprint) when next used after being closed."""

    local = True  # HDF5 resolves the names stored in it on this file system
    request_bytes = 0  # a pread of any size is cheap next to a network round trip

    def __init__(self, name: str, fd: int, fingerprint: Fingerprint, owner: OpenFiles) -> None:
        self.name = name
        self.fingerprint = fingerprint
        #: Reads in flight (and other users) that need the file open; guarded by the owner's lock.
        self.pins = 0
        self._fd = fd
        self._h5: h5py.File | None = None
        self._direct: int | None = None  # its O_DIRECT descriptor, once opened
        self._direct_refused = False  # the file system refused O_DIRECT (open or first read)
        self._h5_opened = False
        self._owner = owner
        self._opening = threading.Lock()  # one thread at a time opens this file's handles
        with owner.lock:
            owner.open[self] = None

    @property
    def size(self) -> int:
        return self.fingerprint.size

    @property
    def fd(self) -> int:
        """The open descriptor (-1 when closed): valid while the file is pinned."""
        return self._fd

    def detach(self) -> tuple[int, h5py.File | None]:
        """Take the file's handles out of it, to close (with the owner's lock held; not pinned)."""
        if self.pins:  # a bug: not an assert, which `python -O` would drop
            raise AssertionError(f"{self.name}: closing a file that a read has pinned")
        return self.take()

    def take(self) -> tuple[int, h5py.File | None]:
        """Take the file's handles out of it, pinned or not (with the owner's lock held)."""
        self._owner.open.pop(self, None)
        fd, h5 = self._fd, self._h5
        self._fd, self._h5 = -1, None
        if self._direct is not None:
            os.close(self._direct)  # opened again with the file, if it is
            self._direct = None
        return fd, h5

    def direct_fd(self) -> int | None:
        """A second descriptor of this very file with ``O_DIRECT`` (reads around the page cache,
        :mod:`._direct`), while the file is pinned; None where the file system refuses it (and
        after :meth:`refuse_direct`). Opened on first use, closed with the file."""
        with self._owner.lock:
            if self._direct_refused:
                return None
            if self._direct is None and self._fd >= 0:
                fd = open_direct(self._fd, self.fingerprint.dev, self.fingerprint.ino)
                if fd < 0:
                    self._direct_refused = True
                    return None
                self._direct = fd
            return self._direct

    def refuse_direct(self) -> None:
        """Read this file through the page cache from now on (a direct read was refused). The
        descriptor stays open until the file's are closed: other threads may be reading from it."""
        with self._owner.lock:
            self._direct_refused = True

    def pin(self) -> int:
        """Keep the file open until :meth:`unpin`, opening it again if it was closed; returns
        its descriptor. ReadError if it cannot be opened again as it was catalogued."""
        owner = self._owner
        with owner.lock:
            if self._fd >= 0:
                self.pins += 1
                owner.open.move_to_end(self)
                return self._fd
        with self._opening:
            with owner.lock:
                if self._fd >= 0:  # opened again by another thread meanwhile
                    self.pins += 1
                    owner.open.move_to_end(self)
                    return self._fd
                if owner.closed:
                    raise ReadError(f"{self.name}: cannot read: the source is closed")
            owner.make_room()
            fd = self._reopen()
            with owner.lock:
                if owner.closed:
                    os.close(fd)
                    raise ReadError(f"{self.name}: cannot read: the source is closed")
                self._fd = fd
                self.pins += 1
                owner.open[self] = None
            return fd

    def unpin(self) -> None:
        with self._owner.lock:
            if self.pins <= 0:  # a bug: not an assert, which `python -O` would drop
                raise AssertionError(f"{self.name}: unpinned more often than pinned")
            self.pins -= 1

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """The file stays open (descriptor and h5py handle) while the block runs."""
        self.pin()
        try:
            yield
        finally:
            self.unpin()

    def _reopen(self) -> int:
        """A new descriptor of the file, checked against the catalogued fingerprint."""
        gone = f"{self.name}: the file changed since the layer opened it"
        try:
            fd = self._owner.os_open(self.name)
        except FileNotFoundError as exc:
            raise self._named(ReadError(f"{gone}: deleted, or renamed away")) from exc
        except OSError as exc:
            hint = self._owner.limit_hint() if exc.errno in (errno.EMFILE, errno.ENFILE) else ""
            raise self._named(
                ReadError(f"{self.name}: cannot open the file again: {exc}{hint}")
            ) from exc
        try:
            change = self.fingerprint.change(Fingerprint.of(os.fstat(fd)))
            if change is not None:
                raise self._named(
                    ReadError(
                        f"{gone}: {change} (seen when it was opened again, after being closed to "
                        "keep the files open under the limit)"
                    )
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def h5py_file(self) -> h5py.File:
        """The file opened with h5py (blocking; closed with the file's descriptor, opened again
        on the next call). Call it while the file is pinned, and use the handle only then."""
        with self.pinned(), self._opening:
            if self._h5 is None:
                self._h5 = self._open_h5()
                self._h5_opened = True
            return self._h5

    def _open_h5(self) -> h5py.File:
        # The first time, for the catalog: a SourceError. Opened again for a read during an
        # epoch (it was closed to make room), a failure is that read's ReadError.
        error = ReadError if self._h5_opened else SourceError
        try:
            try:
                h5 = h5py.File(self.name, "r")
            except OSError as exc:
                if not _out_of_descriptors(exc):
                    raise
                self._owner.make_room(everything=True)
                h5 = h5py.File(self.name, "r")
        except OSError as exc:
            hint = self._owner.limit_hint() if _out_of_descriptors(exc) else ""
            raise self._named(error(f"cannot open HDF5 file {self.name!r}: {exc}{hint}")) from exc
        # By path: HDF5 resolves external links and sources relative to the file's folder.
        # It must be the file our descriptor has open, not one renamed into its place.
        try:
            st = os.fstat(h5.id.get_vfd_handle())
        except Exception:  # a driver without a descriptor: compare the path instead
            st = os.stat(self.name)
        if (st.st_dev, st.st_ino) != (self.fingerprint.dev, self.fingerprint.ino):
            h5.close()
            raise self._named(error(f"{self.name}: the file was replaced while it was opened"))
        return h5

    def close_h5py(self) -> None:
        with self._opening, self._owner.lock:
            h5, self._h5 = self._h5, None
        if h5 is not None:
            h5.close()

    def check(self, *, by_name: bool = False) -> None:
        with self.pinned():
            try:
                now = Fingerprint.of(os.fstat(self._fd))
            except OSError as exc:
                raise self._named(ReadError(f"{self.name}: cannot check the file: {exc}")) from exc
        change = self.fingerprint.change(now)
        if change is None and by_name:
            try:
                named = Fingerprint.of(os.stat(self.name))
            except FileNotFoundError:
                change = "deleted"
            except OSError as exc:
                raise self._named(ReadError(f"{self.name}: cannot check the file: {exc}")) from exc
            else:
                change = self.fingerprint.change(named)
        if change is not None:
            raise self._named(
                ReadError(f"{self.name}: the file was {change} after the source was opened")
            )

    def _named(self, exc: E) -> E:
        """``exc``, an error about this file, saying where the source named it (its list
        file's line: :func:`~._base.name_entry`)."""
        return name_entry(exc, self.name)

    def close(self) -> None:
        """Close the file's handles now (pinned or not: the source is closing)."""
        with self._owner.lock:
            fd, h5 = self.take()
        _close(fd, h5)
