"""Local files: ``preadv`` on threads of the source's own (``ASYNCHDF5_NICE`` can put them
below the consumer: :mod:`.._priority`), from descriptors of which a bounded number is open
(:mod:`._handles`: thousands of files fit any ``ulimit -n``).

Each file is opened when it is catalogued, and its fingerprint (device, inode, size, mtime,
ctime) taken from the open descriptor. Every fetch pins the files it reads (none is closed under
it), reads from their descriptors and then checks the fingerprint again (one ``fstat``): a file
rewritten in place or truncated is a :class:`~asynchdf5.ReadError`, even when its size and mtime
were restored (the ctime cannot be). A file deleted or replaced by a rename keeps being read,
consistently, from the descriptor opened first, while it stays open; once closed to make room
for others, it is opened again by name and must match its fingerprint, else ``ReadError``.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import anyio
import anyio.to_thread

from .._errors import DataLayerError, ReadError, SourceError
from .._fileio import pread_into
from .._pages import populate
from .._priority import background
from .._stats import ReadStats
from ._base import (
    HDF5_SIGNATURE,
    ByteRange,
    StoredFile,
    Streaming,
    name_entry,
    signature_offsets,
)
from ._direct import DIRECT_BYTES, DIRECT_MIN, DONTNEED, WILLNEED, advise, read_direct
from ._handles import Fingerprint, LocalFile, OpenFiles

__all__ = ["PIECE_BYTES", "Fingerprint", "LocalFile", "LocalSource"]

#: Bytes moved per worker-thread call: bounds how long a call holds a thread, so cancelling a
#: run never waits for more than this per thread.
PIECE_BYTES = 32 * 2**20
#: Bytes of raw-read buffers a source keeps for reuse once their ``then`` has returned: about
#: what its reading threads hold in flight while the decoding threads catch up.
KEEP_RAW_BYTES = 32 * 2**20
#: Files one worker-thread call reads at most: each is pinned open until the call checks it.
#: Fewer where the open-file limit is low: every reading thread's calls together pin at most
#: half of the files the source may keep open (:meth:`LocalSource.fetch`).
FILES_PER_PIECE = 16


class RawBuffers:
    """Buffers for the raw bytes of ranges read for their ``then`` (stored chunks to decode),
    handed back once ``then`` has returned and reused, up to ``keep`` bytes of them: a fresh
    buffer per range costs its pages' first touch (and their return to the system) on every
    read, as much CPU as the read itself. Thread-safe: taken by reading threads, given back by
    the decoding threads."""

    def __init__(self, keep: int = KEEP_RAW_BYTES) -> None:
        self.keep = keep
        # Kept buffers by size, smallest first, and their sizes: a take is a bisection, not a
        # scan of every kept buffer (hundreds of small chunks' buffers fit ``keep``).
        self._free: list[bytearray] = []
        self._sizes: list[int] = []
        self._held = 0  # bytes in ``_free``
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (contents undefined): the smallest kept one that
        holds them, else a new one."""
        with self._lock:
            i = bisect.bisect_left(self._sizes, size)
            if i < len(self._sizes):
                del self._sizes[i]
                buf = self._free.pop(i)
                self._held -= len(buf)
                return buf
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Hand ``buf`` back: no view of it may be used after this."""
        n = len(buf)
        with self._lock:
            if self._held + n <= self.keep:
                i = bisect.bisect_right(self._sizes, n)
                self._sizes.insert(i, n)
                self._free.insert(i, buf)
                self._held += n

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free, self._sizes, self._held = [], [], 0


class LocalSource:
    """The files of a source on local (or network-mounted) file systems, at most
    ``max_open`` of them open at once (default: :func:`._handles.open_limit`)."""

    #: See :attr:`Source.piece_bytes <._base.Source.piece_bytes>`.
    piece_bytes = PIECE_BYTES

    def __init__(self, max_open: int | None = None) -> None:
        self._files: dict[str, LocalFile] = {}
        self._open = OpenFiles(max_open)
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None  # made at the first fetch
        self._files_per_call = FILES_PER_PIECE
        self._closed = False
        self._raws = RawBuffers()  # raw chunk runs' buffers, reused

    def exists(self, name: str) -> bool:
        return os.path.isfile(name)

    def open_link_target(self, filename: str, link_file: StoredFile) -> LocalFile:
        # HDF5 opened the target by this name, relative to the working directory if relative.
        return self.open(os.path.abspath(filename))

    def open(self, name: str, *, hdf5: bool = True) -> LocalFile:
        with self._lock:
            if self._closed:
                raise SourceError(f"cannot open {name!r}: the source is closed")
            found = self._files.get(name)
        if found is not None:
            return found
        kind = "HDF5 file" if hdf5 else "file"
        if os.path.isdir(name):
            raise SourceError(f"{name!r} (named in the source) is a directory, not an HDF5 file")
        self._open.make_room()
        try:
            fd = self._open.os_open(name)
        except FileNotFoundError as exc:
            raise SourceError(f"{kind} {name!r} does not exist") from exc
        except PermissionError as exc:
            raise SourceError(f"{kind} {name!r} is not readable (permission denied)") from exc
        except OSError as exc:
            hint = self._open.limit_hint() if exc.errno in (errno.EMFILE, errno.ENFILE) else ""
            raise SourceError(f"cannot open {kind} {name!r}: {exc}{hint}") from exc
        try:
            fingerprint = Fingerprint.of(os.fstat(fd))
            if hdf5 and not is_hdf5_file_fd(fd):
                raise SourceError(f"{name!r} (named in the source) is not an HDF5 file")
        except BaseException:
            os.close(fd)
            raise
        file = LocalFile(name, fd, fingerprint, self._open)
        with self._lock:
            kept = None if self._closed else self._files.setdefault(name, file)
        if kept is not file:
            file.close()  # another thread opened it first, or the source closed meanwhile
        if kept is None:
            raise SourceError(f"cannot open {name!r}: the source is closed")
        return kept

    async def fetch(
        self,
        ranges: Sequence[ByteRange],
        work: Executor,
        limiter: anyio.CapacityLimiter,
        stats: ReadStats,
        *,
        streaming: Streaming | None = None,
    ) -> int:
        with self._lock:
            if self._closed:
                raise ReadError(_closed_message(ranges))
            if self._readers is None:
                tokens = limiter.total_tokens
                n = int(tokens) if math.isfinite(tokens) else (os.cpu_count() or 1)
                self._readers = ThreadPoolExecutor(
                    max(1, n), "asynchdf5-read", initializer=background
                )
                # Each thread's call pins its files: all of them together stay within half the
                # open-file limit, so pins never hold more descriptors than the process has.
                self._files_per_call = max(
                    1, min(FILES_PER_PIECE, self._open.limit // (2 * max(1, n)))
                )
            readers = self._readers
            per_call = self._files_per_call
        # In file order: each thread's call then reads ahead through its part of the file.
        ordered = sorted(ranges, key=lambda r: (id(r.file), r.offset))
        async with anyio.create_task_group() as tg:
            # Streaming, calls of a direct read each: more of them in flight for the disk.
            scattered = streaming == "scattered"
            piece = DIRECT_BYTES if scattered else PIECE_BYTES
            for batch in _batches(ordered, piece, per_call):
                tg.start_soon(
                    self._fetch_in_thread, batch, work, limiter, readers, self._raws, streaming
                )
        return sum(r.size for r in ranges)

    @staticmethod
    async def _fetch_in_thread(
        batch: list[ByteRange],
        work: Executor,
        limiter: anyio.CapacityLimiter,
        readers: Executor,
        raws: RawBuffers,
        streaming: Streaming | None = None,
    ) -> None:
        def read() -> None:
            try:
                future = readers.submit(_fetch, batch, work, raws, streaming)
            except RuntimeError:  # the pool was shut down: the source closed under this fetch
                raise ReadError(_closed_message(batch)) from None
            future.result()

        # The copy runs in our pool's thread; one of anyio's only waits for it. Submitted from
        # that thread, so that a read starts only once anyio runs the call, which it then does
        # not abandon when cancelled: nothing writes into a slot after its chunk is given up.
        await anyio.to_thread.run_sync(read, limiter=limiter)

    def close(self) -> None:
        """Close every file, after the reads under way end; later opens and fetches raise."""
        with self._lock:
            self._closed = True
            files, self._files = list(self._files.values()), {}
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)
        self._raws.clear()
        self._open.close()
        for f in files:
            f.close()


def _closed_message(ranges: Sequence[ByteRange]) -> str:
    where = f"{ranges[0].file.name}: {ranges[0].about}: " if ranges else ""
    return f"{where}cannot read: the source is closed"


def is_hdf5_file_fd(fd: int) -> bool:
    """:func:`is_hdf5_file` on an open descriptor."""
    offsets = signature_offsets(os.fstat(fd).st_size)
    return any(os.pread(fd, 8, offset) == HDF5_SIGNATURE for offset in offsets)


def _batches(
    ranges: Sequence[ByteRange], piece: int, most_files: int = FILES_PER_PIECE
) -> Iterator[list[ByteRange]]:
    """Consecutive ranges, about ``piece`` bytes per batch (one worker-thread call each), of at
    most ``most_files`` files (each pinned open for the call)."""
    batch: list[ByteRange] = []
    size = 0
    files: set[int] = set()
    for r in ranges:
        new_file = id(r.file) not in files
        if batch and (size + r.size > piece or (new_file and len(files) >= most_files)):
            yield batch
            batch, size, files = [], 0, set()
        batch.append(r)
        size += r.size
        files.add(id(r.file))
    if batch:
        yield batch


def _fetch(
    batch: list[ByteRange],
    work: Executor,
    raws: RawBuffers,
    streaming: Streaming | None = None,
) -> None:
    """Read a batch of ranges (blocking); raw bytes go to their ``then`` on ``work``'s threads,
    in a buffer of ``raws`` (given back once ``then`` returns).

    Every ``then`` handed to ``work`` has finished when this returns, errors or not: nothing
    writes into a cache slot after its chunk was given up.

    ``streaming`` (data larger than memory, read once an epoch; :mod:`._direct` has the
    sizes): ``"scattered"`` ranges (blocks and lanes of a shuffled epoch) bypass the page cache
    (``O_DIRECT``, through an aligned buffer of the thread's: filling the page cache only for the
    kernel's reclaim to empty it again costs, under a memory limit, more CPU than the read, and
    in the reading thread itself); where the file system refuses that, and for raw chunks, the
    kernel is told of the batch's ranges first (``WILLNEED``: it reads them all at once, where
    one ``preadv`` at a time leaves the disk one request deep). ``"in order"`` ranges (an epoch
    read chunk after chunk) go through the page cache, whose read-ahead streams them faster than
    direct reads. Either way a range read through the page cache is dropped once read
    (``DONTNEED``), but for short ones (``DIRECT_MIN``), which are read as usual. Advice only: a
    failure to give it changes nothing.
    """
    pending: list[tuple[ByteRange, Future[None]]] = []
    files: dict[int, LocalFile] = {}
    error: BaseException | None = None
    try:
        for r in batch:
            f = r.file
            assert isinstance(f, LocalFile)
            if id(f) not in files:
                try:
                    f.pin()  # open (again) until checked below: never closed under a read
                except ReadError as exc:
                    raise ReadError(f"{r.about}: {exc}") from exc
                files[id(f)] = f
        # The ranges read around the page cache: scattered ones with O_DIRECT where the file
        # takes it, the others with advice (in order, the kernel reads ahead by itself: WILLNEED
        # on long ranges made it slower).
        around = {id(r) for r in batch if streaming and r.size >= DIRECT_MIN}
        direct = {
            id(r) for r in batch if id(r) in around and streaming == "scattered" and _direct(r)
        }
        _advise(
            [
                r
                for r in batch
                if id(r) in around and id(r) not in direct and streaming == "scattered"
            ],
            WILLNEED,
        )
        for r in batch:
            f = r.file
            assert isinstance(f, LocalFile)
            if r.into is not None:
                if not (id(r) in direct and _read_direct(f, r)):
                    direct.discard(id(r))  # refused: read through the page cache
                    if r.fresh:
                        populate(r.into)
                    _preadv(f, r)
                if r.then is not None:
                    r.then(r.into)
            else:
                assert r.then is not None
                buf = raws.take(r.size)
                try:
                    _preadv(f, r, memoryview(buf)[: r.size])
                except BaseException:
                    raws.give(buf)
                    raise
                pending.append((r, work.submit(_then_and_give, r, buf, raws)))
            if id(r) in around and id(r) not in direct:
                _advise((r,), DONTNEED)
    except BaseException as exc:
        error = exc
    for _, future in pending:
        failed = future.exception()
        if failed is not None and error is None:
            error = failed
    # After the reads: catches a change before or during them. Checked on a failed read too,
    # since a file that changed (say, truncated) is the cause to report, not the short read.
    pinned = list(files.values())
    try:
        for r in batch:
            f = r.file
            if id(f) in files:
                del files[id(f)]
                try:
                    f.check()
                except ReadError as exc:
                    raise ReadError(f"{r.about}: {exc}") from exc
    finally:
        for f in pinned:
            f.unpin()
    if error is not None:
        raise _read_error(error, batch[0])


def _direct(r: ByteRange) -> bool:
    """Whether ``r`` can be read with ``O_DIRECT`` (a buffer to read into, a file that takes it)."""
    return r.into is not None and isinstance(r.file, LocalFile) and r.file.direct_fd() is not None


def _read_direct(f: LocalFile, r: ByteRange) -> bool:
    """:func:`~._direct.read_direct` of ``r``; False (nothing read) where the file's descriptor
    refuses direct reads (it is then read through the page cache from now on)."""
    assert r.into is not None
    fd = f.direct_fd()
    if fd is None:
        return False
    try:
        if read_direct(fd, r.offset, r.size, r.into, f"{f.name}: {r.about}"):
            return True
    except ReadError as exc:
        name_entry(exc, f.name)
        raise
    f.refuse_direct()
    return False


def _advise(ranges: Sequence[ByteRange], advice: int | None) -> None:
    for r in ranges:
        f = r.file
        assert isinstance(f, LocalFile)
        advise(f.fd, r.offset, r.size, advice)


def _read_error(exc: BaseException, r: ByteRange) -> BaseException:
    if isinstance(exc, DataLayerError) or not isinstance(exc, Exception):
        return exc
    err = ReadError(f"{r.file.name}: {r.about}: read failed: {type(exc).__name__}: {exc}")
    name_entry(err, r.file.name)
    err.__cause__ = exc
    return err


def _then_and_give(r: ByteRange, buf: bytearray, raws: RawBuffers) -> None:
    """``r.then`` on its bytes in ``buf``, then ``buf`` back to ``raws`` (the range's ``then``
    keeps no view of its bytes past its return: :class:`~._base.ByteRange`)."""
    assert r.then is not None
    try:
        r.then(memoryview(buf)[: r.size])
    finally:
        raws.give(buf)


def _preadv(f: LocalFile, r: ByteRange, into: memoryview | None = None) -> None:
    """Read ``r`` into ``into`` (default: ``r.into``), whole: a file ending before the range's
    end is a ``ReadError`` naming it truncated."""
    into = into if into is not None else r.into
    assert into is not None
    view = into.cast("B") if into.format != "B" else into
    try:
        done = pread_into(f.fd, view[: r.size], r.offset)
    except OSError as exc:
        raise name_entry(ReadError(f"{f.name}: {r.about}: read failed: {exc}"), f.name) from exc
    if done < r.size:
        raise name_entry(
            ReadError(
                f"{f.name}: {r.about}: unexpected end of file at byte {r.offset + done} "
                "(the file is truncated)"
            ),
            f.name,
        )
