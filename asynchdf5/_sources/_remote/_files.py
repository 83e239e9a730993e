"""Remote objects as the catalog sees them (:class:`~.._base.StoredFile`), and h5py's file object
over one; both read through the source's :class:`~._fetch.Fetcher`."""

from __future__ import annotations

import contextlib
import io
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import h5py

from ..._errors import DataLayerError, SourceError
from ._errors import ReadFailed, describe

if TYPE_CHECKING:
    from ._fetch import Fetcher
    from ._stores import Store


class RemoteFile:
    """A remote object, with the size and version it had when opened."""

    #: Names stored in a remote file (external links, ...) are not local paths.
    local = False

    def __init__(
        self,
        fetcher: Fetcher,
        store: Store,
        url: str,
        size: int,
        version: dict[str, str],
        head: bytes,
    ) -> None:
        self.url = url
        self.name = fetcher.scrub(url)
        self.version = version
        self._size = size
        self._fetcher = fetcher
        self.store = store
        self._head = head  # the first bytes, fetched at open: h5py starts there
        self._h5: h5py.File | None = None
        self._io: RangeFile | None = None
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    @property
    def request_bytes(self) -> int:
        """One whole request of the source (smaller blocks are a request each)."""
        return self._fetcher.transfer.part_bytes

    def h5py_file(self) -> h5py.File:
        with self._lock:
            if self._h5 is None:
                io_ = RangeFile(self, self._fetcher, self._head)
                try:
                    self._h5 = h5py.File(io_, "r")
                except DataLayerError:
                    raise
                except (OSError, ValueError) as exc:
                    cause = exc.__cause__ if isinstance(exc, ReadFailed) else exc
                    raise SourceError(
                        f"cannot open HDF5 file {self.name!r}: {describe(exc)}"
                    ) from cause
                self._io = io_
            return self._h5

    def close_h5py(self) -> None:
        with self._lock:
            h5, self._h5 = self._h5, None
            io_, self._io = self._io, None
        if h5 is not None:
            h5.close()
        if io_ is not None:
            io_.close()

    def check(self, *, by_name: bool = False) -> None:
        self._fetcher.check(self)

    def pinned(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # no descriptor to keep: nothing is closed between reads


class RangeFile(io.RawIOBase):
    """A read-only file object over a remote object, for h5py: reads go through the source's
    retries and version checks, in blocks of which the last few are kept (h5py's metadata reads
    are small and close together). A read of two blocks or more goes straight to the buffer, in
    concurrent parts."""

    def __init__(self, file: RemoteFile, fetcher: Fetcher, head: bytes) -> None:
        super().__init__()
        self._file = file
        self._fetcher = fetcher
        t = fetcher.transfer
        self._block = t.metadata_block
        self._keep = t.metadata_blocks
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._pos = 0
        for i in range(len(head) // self._block + (len(head) % self._block > 0)):
            piece = head[i * self._block : (i + 1) * self._block]
            if len(piece) == self._block or i * self._block + len(piece) == file.size:
                self._blocks[i] = piece

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._file.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._file.size - self._pos))
        if n == 0:
            return 0
        start, stop = self._pos, self._pos + n
        try:
            if n >= 2 * self._block:
                self._fetcher.read_into(self._file, start, view[:n])
            else:
                b = self._block
                for k in range(start // b, (stop - 1) // b + 1):
                    data = self._get_block(k)
                    lo, hi = max(start, k * b), min(stop, k * b + len(data))
                    view[lo - start : hi - start] = data[lo - k * b : hi - k * b]
        except DataLayerError as exc:
            raise ReadFailed(str(exc)) from exc
        self._pos = stop
        return n

    def _get_block(self, k: int) -> bytes:
        data = self._blocks.get(k)
        if data is not None:
            self._blocks.move_to_end(k)
            return data
        b = self._block
        data = self._fetcher.read(self._file, k * b, min(self._file.size, (k + 1) * b))
        self._blocks[k] = data
        while len(self._blocks) > self._keep:
            self._blocks.popitem(last=False)
        return data

    def close(self) -> None:
        self._blocks.clear()
        super().close()
