"""The source seam: where the bytes of HDF5 files come from.

A :class:`Source` opens the files of a source (each a :class:`StoredFile`, with a fingerprint
taken when it is opened) and fetches byte ranges of them: into a buffer (data stored
contiguously, read straight into a cache slot) or handed as bytes to a callable (a raw chunk to
decode). The catalog reads metadata through each file's h5py handle, the chunk reader plans the
byte ranges, and the source decides how they move: local files with ``preadv`` on worker threads,
remote objects with concurrent ranged requests. Nothing above this seam knows which.

Integrity is the source's job too: a file that changed since it was opened (rewritten in place,
truncated) is a :class:`~asynchdf5.ReadError` when its bytes are fetched, never wrong rows.

The names a source takes (paths, URLs, ``file://`` URLs) and the signature that makes a file
HDF5 are defined here too, once, for every source and for the resolution of the source property.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import anyio

if TYPE_CHECKING:
    import h5py

    from .._stats import ReadStats

__all__ = [
    "HDF5_SIGNATURE",
    "ByteRange",
    "Source",
    "StoredFile",
    "Streaming",
    "file_url_path",
    "is_url",
    "name_entry",
    "signature_offsets",
]

E = TypeVar("E", bound=BaseException)

#: The 8-byte signature an HDF5 file starts with (at offset 0, 512, 1024, 2048, ... when a user
#: block precedes it).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def name_entry(exc: E, entry: str) -> E:
    """Add to the message of ``exc`` (an error about ``entry``'s file) where the source named
    the entry, as ``" (train.txt, line 3)"`` (an :class:`~._entries.Entry` knows; a plain name
    adds nothing): the one place such messages get it. Returns ``exc``."""
    where = getattr(entry, "where", None)
    if not where or not exc.args or not isinstance(exc.args[0], str):
        return exc
    suffix = f" ({where})"
    if not exc.args[0].endswith(suffix):
        exc.args = (exc.args[0] + suffix, *exc.args[1:])
    return exc


def signature_offsets(size: int) -> Iterator[int]:
    """Where :data:`HDF5_SIGNATURE` may stand in a file of ``size`` bytes: at 0, or after a
    user block of 512, 1024, 2048, ... bytes (each source reads them its own way)."""
    offset = 0
    while offset + 8 <= size:
        yield offset
        offset = 512 if offset == 0 else offset * 2


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(entry: str) -> bool:
    """Whether ``entry`` is a URL (``s3://...``, ``https://...``), not a local path."""
    return _URL.match(entry) is not None


def file_url_path(url: str) -> str | None:
    """The local path of a ``file://`` URL (None for other URLs)."""
    if not url.lower().startswith("file://"):
        return None
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        return None  # a file on another host: leave it to fsspec
    return os.path.normpath(unquote(parts.path))


#: How a fetch's ranges are read from data larger than memory (see :meth:`Source.fetch`).
Streaming = Literal["in order", "scattered"]


class StoredFile(Protocol):
    """One file of a source, catalogued once for the layer's life."""

    #: The path or URL, as messages show it.
    name: str

    @property
    def local(self) -> bool:
        """Whether the file is on the local file system, where HDF5 resolves the names stored
        in it (external links, external raw storage, virtual dataset sources) as the file means
        them. A remote object's stored names would be looked up locally, never what the file
        means, so the catalog refuses such layouts in it."""
        ...

    @property
    def size(self) -> int:
        """Bytes in the file when it was opened."""
        ...

    @property
    def request_bytes(self) -> int:
        """Bytes a read of this file should move at least to be worth what one request costs
        (0: a read of any size is cheap). Remote objects pay a round trip and the client's
        work per request, so default shuffle blocks of their samples are at least this big."""
        ...

    def h5py_file(self) -> h5py.File:
        """The file opened with h5py (blocking; opened on first use and kept until
        :meth:`close_h5py`, or until a local source closes the file to make room: use it while
        the file is :meth:`pinned`). It reads the same bytes as :meth:`Source.fetch`, even when
        the path is replaced meanwhile."""
        ...

    def close_h5py(self) -> None:
        """Close the h5py handle, if open (blocking)."""
        ...

    def pinned(self) -> AbstractContextManager[None]:
        """Keep the file open while the block runs (blocking). A local source keeps a bounded
        number of files open, closing the least recently used between reads and opening them
        again (checked against their fingerprints, else :class:`~asynchdf5.ReadError`) when
        next used; every read pins its file, and so does any user of :meth:`h5py_file`."""
        ...

    def check(self, *, by_name: bool = False) -> None:
        """Raise :class:`~asynchdf5.ReadError` if the file changed since it was opened
        (blocking). ``by_name``: also if its name now names another file, or none (for files
        that HDF5 itself opens by name, such as the sources of a virtual dataset)."""
        ...


@dataclass(eq=False, slots=True)
class ByteRange:
    """``size`` bytes at ``offset`` of ``file``, to fetch.

    The bytes go into ``into`` (a writable buffer of ``size`` bytes), or, when ``into`` is None,
    to ``then`` (as ``bytes`` or a buffer, valid only until ``then`` returns: a source may reuse
    it for the next range). ``then`` runs on a worker thread once the bytes are in (for
    ``into``, with ``into``); its exceptions propagate. ``about`` says which
    rows of which top the range holds, for error messages.
    """

    file: StoredFile
    offset: int
    size: int
    about: str
    into: memoryview | None = None
    then: Callable[[bytes | memoryview], None] | None = None
    #: ``into`` was never written (a resident array's rows, read once): a local source faults
    #: its pages in at once before reading (:func:`~.._pages.populate`).
    fresh: bool = False


class Source(Protocol):
    """Where the bytes of a layer's HDF5 files come from (local files, remote objects)."""

    @property
    def piece_bytes(self) -> int:
        """Bytes one range (or one h5py read) should move at most: the chunk reader cuts longer
        contiguous reads into pieces of this size. It bounds how long one worker-thread call of
        the source holds its thread, so that cancelling a read never waits for more than a
        piece per thread."""
        ...

    def open(self, name: str, *, hdf5: bool = True) -> StoredFile:
        """Open ``name`` (blocking). ``hdf5=False``: a file of raw bytes (external storage).

        Raises :class:`~asynchdf5.SourceError` naming the file when it is missing, unreadable or
        (with ``hdf5``) not HDF5.
        """
        ...

    def open_link_target(self, filename: str, link_file: StoredFile) -> StoredFile:
        """The file that HDF5 opened, as ``filename``, to follow an external link in
        ``link_file`` (blocking). A source that cannot read such a file the way HDF5 did
        raises :class:`~asynchdf5.SourceError` naming the link."""
        ...

    def exists(self, name: str) -> bool:
        """Whether ``name`` names a file (blocking)."""
        ...

    async def fetch(
        self,
        ranges: Sequence[ByteRange],
        work: Executor,
        limiter: anyio.CapacityLimiter,
        stats: ReadStats,
        *,
        streaming: Streaming | None = None,
    ) -> int:
        """Fetch every range (concurrently, in any order), then check the files they came from.

        ``streaming``: the ranges belong to data larger than memory, read once an epoch, so
        nothing is gained by keeping them cached after the fetch; a source may read around its
        cache. ``"in order"``: an epoch read in order, chunk after chunk (local files: through
        the kernel's read-ahead, dropped once read); ``"scattered"``: blocks from all over the
        data set (local files: ``O_DIRECT``).

        ``then`` callables run on ``work``'s threads; at most ``limiter``'s tokens of worker
        threads move bytes at a time. Returns the bytes fetched; transient errors retried are
        counted in ``stats.retries``. Raises :class:`~asynchdf5.ReadError` naming the file and
        the range's ``about``.
        """
        ...

    def close(self) -> None:
        """Close every file it opened (blocking)."""
        ...
