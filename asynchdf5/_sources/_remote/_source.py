"""The remote source: its state and lifecycle, opening objects, and source list files given as
URLs. Its requests are :class:`~._requests.Requests`, its fetches :class:`~._fetcher.Fetcher`
(the base classes)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._errors import SourceError
from .._base import HDF5_SIGNATURE, StoredFile, file_url_path, is_url
from .._local import LocalFile, LocalSource
from . import _transfer
from ._cache import DiskCache
from ._errors import SCHEME, Secrets, classify, describe, status_of
from ._fetch import Buffers
from ._fetcher import Fetcher
from ._files import RemoteFile
from ._loop import LoopThread
from ._stores import Store, make_store
from ._transfer import Transfer


class RemoteSource(Fetcher):
    """The files of a source given as fsspec URLs (local paths and ``file://`` URLs among them
    are read as local files).

    Parameters
    ----------
    storage_options
        Options for the fsspec filesystem (credentials, ``endpoint_url``, ...).
    cache, cache_bytes
        The layer's ``remote_cache`` folder and ``remote_cache_bytes`` bound (see
        :class:`DiskCache`).
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        cache: str | None = None,
        cache_bytes: int | None = None,
        transfer: Transfer | None = None,
    ) -> None:
        # Cheap and non-blocking: created on the layer's event loop. Threads, filesystems and
        # the cache folder come with the first remote open, in a worker thread.
        self.transfer = transfer or _transfer.TRANSFER
        self.scrub = Secrets(storage_options)
        self._options = dict(storage_options or {})
        self._cache_folder = cache
        self._cache_bytes = cache_bytes
        self.cache: DiskCache | None = None
        self._local = LocalSource()
        self._files: dict[str, RemoteFile] = {}
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._sem: asyncio.Semaphore | None = None
        self._buffers: Buffers | None = None
        self._closed = False
        #: Counters (for tests and benchmarks): requests sent, bytes received, retries, and the
        #: remote cache's block hits and misses.
        self.requests = 0
        self.bytes_fetched = 0
        self.retries = 0
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def piece_bytes(self) -> int:
        return self._local.piece_bytes  # local files among the entries are read by it

    # --- lifecycle --------------------------------------------------------------------------

    def _start(self) -> LoopThread:
        with self._lock:
            if self._closed:
                raise SourceError("the source is closed")
            if self._loop is None:
                if self._cache_folder is not None and self.cache is None:
                    self.cache = DiskCache(
                        self._cache_folder, self._cache_bytes, self.transfer.cache_block
                    )
                self._pool = ThreadPoolExecutor(4, "asynchdf5-remote-io")
                self._loop = LoopThread("asynchdf5-remote")
            return self._loop

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        try:
            for f in files:  # while the loop runs: HDF5 may still read as it closes a file
                f.close_h5py()
            self._local.close()
        finally:
            with self._lock:
                self._closed = True
                loop, self._loop = self._loop, None
                pool, self._pool = self._pool, None
                stores, self._stores = list(self._stores.values()), {}
            if loop is not None:
                try:
                    loop.run(self._close_stores(stores))
                finally:
                    loop.stop()
            if pool is not None:
                pool.shutdown(wait=True)

    @staticmethod
    async def _close_stores(stores: Sequence[Store]) -> None:
        for store in stores:
            with contextlib.suppress(Exception):  # closing what may be half open
                await store.close()
        # A closed transport lets go of its socket on the loop's next turns: take them before
        # the loop stops, or the sockets would wait for the garbage collector.
        for _ in range(3):
            await asyncio.sleep(0)

    # --- opening ----------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        path = file_url_path(name) if is_url(name) else name
        if path is not None:
            return self._local.exists(path)
        try:
            self._start().run(self._head(name))
        except Exception:
            return False
        return True

    async def _head(self, url: str) -> tuple[int, dict[str, str]]:
        return await self._store(url).head(url)

    def open_link_target(self, filename: str, link_file: StoredFile) -> StoredFile:
        if isinstance(link_file, LocalFile):
            return self._local.open_link_target(filename, link_file)
        raise SourceError(
            f"{link_file.name}: an external link to {filename!r}: external links in remote "
            "files are not supported (HDF5 would look the target up on the local file system)"
        )

    def open(self, name: str, *, hdf5: bool = True) -> StoredFile:
        if not is_url(name):
            return self._local.open(name, hdf5=hdf5)
        path = file_url_path(name)
        if path is not None:
            return self._local.open(path, hdf5=hdf5)
        with self._lock:
            found = self._files.get(name)
        if found is not None:
            return found
        file = self._start().run(self._open(name, hdf5))
        with self._lock:
            self._files.setdefault(name, file)
            return self._files[name]

    def _store(self, url: str) -> Store:
        """The store of ``url``'s protocol, created on first use (on the source's loop)."""
        match = SCHEME.match(url)
        assert match is not None and self._pool is not None
        protocol = match.group(1).lower()
        store = self._stores.get(protocol)
        if store is None:
            store = make_store(url, self._options, self._pool, self.transfer)
            self._stores[protocol] = store
        return store

    def _source_error(self, message: str, cause: BaseException | None) -> SourceError:
        err = SourceError(self.scrub(message))
        if cause is not None and not self.scrub.leaks(cause):
            err.__cause__ = cause
        else:
            err.__suppress_context__ = True
        return err

    def _store_for(self, url: str, kind: str) -> Store:
        """:meth:`_store`, with a SourceError naming ``url`` when there is no such store."""
        shown = self.scrub(url)
        try:
            return self._store(url)
        except ImportError as exc:
            hint = ": pip install 'asynchdf5[remote]'" if "fsspec" in str(exc) else ""
            raise self._source_error(
                f"{kind} {shown!r} is a URL, and remote sources need fsspec and its "
                f"implementation for this protocol ({exc}{hint})",
                exc,
            ) from None
        except Exception as exc:
            raise self._source_error(
                f"cannot open {kind} {shown!r}: {describe(exc)}", exc
            ) from None

    async def _open(self, url: str, hdf5: bool) -> RemoteFile:
        kind = "HDF5 file" if hdf5 else "file"
        store = self._store_for(url, kind)
        n = self.transfer.metadata_block
        try:
            size, version, head = await self._retry(lambda: store.first(url, n), None)
        except Exception as exc:
            raise self._open_error(store, url, kind, exc) from None
        if hdf5 and not await self._is_hdf5(store, url, size, version, head):
            raise SourceError(f"{self.scrub(url)!r} (named in the source) is not an HDF5 file")
        return RemoteFile(self, store, url, size, version, head)

    async def _read_list(self, url: str) -> bytes | None:
        """The bytes of a source list file at ``url``; None if it is an HDF5 file."""
        store = self._store_for(url, "source")
        n = self.transfer.metadata_block
        hint = " (it should be an HDF5 file, or a text file listing HDF5 files)"
        try:
            size, version, head = await self._retry(lambda: store.first(url, n), None)
        except Exception as exc:
            raise self._open_error(store, url, "source", exc, hint) from None
        if await self._is_hdf5(store, url, size, version, head):
            return None
        if size > _LIST_MAX_BYTES:
            raise SourceError(
                f"source {self.scrub(url)!r} is neither an HDF5 file nor a source list file "
                f"({size} bytes); pass a list file naming HDF5 files, an HDF5 file, or a "
                "sequence of URLs"
            )
        if size <= len(head):
            return head[:size]
        try:
            rest = await self._retry(lambda: store.get(url, len(head), size, version), None)
        except Exception as exc:
            raise self._open_error(store, url, "source", exc) from None
        return head + rest

    def _open_error(
        self, store: Store, url: str, kind: str, exc: BaseException, hint: str = ""
    ) -> SourceError:
        shown = self.scrub(url)
        what = classify(exc)
        if what == "missing":
            msg = f"{kind} {shown!r} {store.missing_what(url, exc)}{hint}"
        elif what == "denied":
            code = status_of(exc)[0] or type(exc).__name__
            msg = (
                f"{kind} {shown!r} cannot be read: access denied ({code}); check the credentials "
                "in storage_options or the environment"
            )
        elif what == "transient":
            msg = (
                f"cannot reach {kind} {shown!r} after {self.transfer.attempts} attempts: "
                f"{describe(exc)}"
            )
        else:
            msg = f"cannot open {kind} {shown!r}: {describe(exc)}"
        return self._source_error(msg, exc)

    async def _is_hdf5(
        self, store: Store, url: str, size: int, version: Mapping[str, str], head: bytes
    ) -> bool:
        offset = 0
        while offset + 8 <= size:  # at 0, or after a user block of 512, 1024, 2048, ... bytes
            if offset + 8 <= len(head):
                sig = head[offset : offset + 8]
            else:
                sig = await self._retry(
                    functools.partial(store.get, url, offset, offset + 8, version), None
                )
            if sig == HDF5_SIGNATURE:
                return True
            offset = 512 if offset == 0 else offset * 2
        return False


# --- source list files given as URLs ---------------------------------------------------------

#: A source list file larger than this is not one.
_LIST_MAX_BYTES = 64 * 2**20


def read_source_url(url: str, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """The bytes of the object at ``url`` when it is a source list file; None when it is an HDF5
    file (blocking: at construction). Raises :class:`SourceError` naming the URL."""
    source = RemoteSource(storage_options)
    try:
        loop = source._start()
        return loop.run(source._read_list(url))
    finally:
        source.close()
