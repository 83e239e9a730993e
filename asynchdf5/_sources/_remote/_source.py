"""The remote source: its state and lifecycle, opening objects, the store each protocol is read
through (:func:`make_store`), and source list files given as URLs.

A :class:`RemoteSource` is composed, not derived: a local source for the local paths among its
entries, a store per protocol, one :class:`~._fetch.Fetcher` for every request (made, with its
loop and threads, when the first remote object is opened) and, with ``remote_cache``, a
:class:`~._cache.DiskCache` that the fetcher reads through.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import anyio

from ..._errors import SourceError
from ..._stats import ReadStats
from .._base import (
    HDF5_SIGNATURE,
    ByteRange,
    StoredFile,
    Streaming,
    file_url_path,
    is_url,
    signature_offsets,
)
from .._local import LocalFile, LocalSource
from ._cache import DiskCache
from ._errors import SCHEME, Secrets, classify, describe, status_of
from ._fetch import Fetcher
from ._files import RemoteFile
from ._obstore import CLIENT_VARIABLE, NotTranslated, ObstoreS3, obstore_settings
from ._stores import FsspecStore, S3Store, Store
from ._transfer import Transfer, default_transfer

T = TypeVar("T")

#: A source list file larger than this is not one.
_LIST_MAX_BYTES = 64 * 2**20


class RemoteSource:
    """The files of a source given as fsspec URLs (local paths and ``file://`` URLs among them
    are read as local files).

    Parameters
    ----------
    storage_options
        Options for the fsspec filesystem (credentials, ``endpoint_url``, ...).
    cache, cache_bytes
        The layer's ``remote_cache`` folder and the most bytes it may hold (see
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
        self.transfer = transfer or default_transfer()
        self.scrub = Secrets(storage_options)
        self._options = dict(storage_options or {})
        self._cache_folder = cache
        self._cache_bytes = cache_bytes
        self.cache: DiskCache | None = None
        self._local = LocalSource()
        self._files: dict[str, RemoteFile] = {}
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()
        self._fetcher: Fetcher | None = None
        self._closed = False

    @property
    def piece_bytes(self) -> int:
        return self._local.piece_bytes  # local files among the entries are read by it

    # Counters (for tests and benchmarks): requests sent, bytes received, retries, and the
    # remote cache's block hits and misses.

    @property
    def requests(self) -> int:
        return self._fetcher.requests if self._fetcher else 0

    @property
    def bytes_fetched(self) -> int:
        return self._fetcher.bytes_fetched if self._fetcher else 0

    @property
    def retries(self) -> int:
        return self._fetcher.retries if self._fetcher else 0

    @property
    def cache_hits(self) -> int:
        return self._fetcher.cache_hits if self._fetcher else 0

    @property
    def cache_misses(self) -> int:
        return self._fetcher.cache_misses if self._fetcher else 0

    # --- lifecycle --------------------------------------------------------------------------

    def _start(self) -> Fetcher:
        with self._lock:
            if self._closed:
                raise SourceError("the source is closed")
            if self._fetcher is None:
                if self._cache_folder is not None:
                    self.cache = DiskCache(
                        self._cache_folder, self._cache_bytes, self.transfer.cache_block
                    )
                self._fetcher = Fetcher(self.transfer, self.scrub, self.cache)
            return self._fetcher

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the source's loop (started if need be) and wait (blocking)."""
        try:
            fetcher = self._start()
        except BaseException:
            coro.close()
            raise
        return fetcher.run(coro)

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
                fetcher = self._fetcher  # kept: its counters outlive it
                stores, self._stores = list(self._stores.values()), {}
            if fetcher is not None:
                fetcher.close(_close_stores(stores))

    # --- reading ----------------------------------------------------------------------------

    async def fetch(
        self,
        ranges: Sequence[ByteRange],
        work: Executor,
        limiter: anyio.CapacityLimiter,
        stats: ReadStats,
        *,
        streaming: Streaming | None = None,
    ) -> int:
        remote = [r for r in ranges if isinstance(r.file, RemoteFile)]
        local = [r for r in ranges if not isinstance(r.file, RemoteFile)]
        fetch_local = functools.partial(self._local.fetch, streaming=streaming)
        if not remote:
            return await fetch_local(local, work, limiter, stats)
        fetcher = self._fetcher
        assert fetcher is not None  # it opened the remote files
        if local:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fetch_local, local, work, limiter, stats)
                await fetcher.fetch(remote, work, stats)
        else:
            await fetcher.fetch(remote, work, stats)
        return sum(r.size for r in ranges)

    # --- opening ----------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        path = file_url_path(name) if is_url(name) else name
        if path is not None:
            return self._local.exists(path)
        try:
            self._run(self._head(name))
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
        file = self._run(self._open(name, hdf5))
        with self._lock:
            self._files.setdefault(name, file)
            return self._files[name]

    def _store(self, url: str) -> Store:
        """The store of ``url``'s protocol, created on first use (on the source's loop)."""
        match = SCHEME.match(url)
        assert match is not None and self._fetcher is not None
        protocol = match.group(1).lower()
        store = self._stores.get(protocol)
        if store is None:
            store = make_store(url, self._options, self._fetcher.pool, self.transfer)
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
            fix = ": pip install '.[remote]' in the asynchdf5 checkout"
            hint = fix if "fsspec" in str(exc) else ""
            raise self._source_error(
                f"{kind} {shown!r} is a URL, and remote sources need fsspec and its "
                f"implementation for this protocol ({exc}{hint})",
                exc,
            ) from None
        except Exception as exc:
            raise self._source_error(
                f"cannot open {kind} {shown!r}: {describe(exc)}", exc
            ) from None

    async def _first(
        self, url: str, kind: str, hint: str = ""
    ) -> tuple[Store, int, dict[str, str], bytes]:
        """The store of ``url``, and the object's size, version and first block."""
        assert self._fetcher is not None
        store = self._store_for(url, kind)
        n = self.transfer.metadata_block
        try:
            size, version, head = await self._fetcher.retry(lambda: store.first(url, n), None)
        except Exception as exc:
            raise self._open_error(store, url, kind, exc, hint) from None
        return store, size, version, head

    async def _open(self, url: str, hdf5: bool) -> RemoteFile:
        assert self._fetcher is not None
        store, size, version, head = await self._first(url, "HDF5 file" if hdf5 else "file")
        if hdf5 and not await self._is_hdf5(store, url, size, version, head):
            raise SourceError(f"{self.scrub(url)!r} (named in the source) is not an HDF5 file")
        return RemoteFile(self._fetcher, store, url, size, version, head)

    async def _read_list(self, url: str) -> bytes | None:
        """The bytes of a source list file at ``url``; None if it is an HDF5 file."""
        assert self._fetcher is not None
        hint = " (it should be an HDF5 file, or a text file listing HDF5 files)"
        store, size, version, head = await self._first(url, "source", hint)
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
        get = functools.partial(store.get, url, len(head), size, version)
        try:
            rest = await self._fetcher.retry(get, None)
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
        assert self._fetcher is not None
        for offset in signature_offsets(size):
            if offset + 8 <= len(head):
                sig = head[offset : offset + 8]
            else:
                get = functools.partial(store.get, url, offset, offset + 8, version)
                sig = await self._fetcher.retry(get, None)
            if sig == HDF5_SIGNATURE:
                return True
        return False


async def _close_stores(stores: Sequence[Store]) -> None:
    for store in stores:
        with contextlib.suppress(Exception):  # closing what may be half open
            await store.close()
    # A closed transport lets go of its socket on the loop's next turns: take them before the
    # loop stops, or the sockets would wait for the garbage collector.
    for _ in range(3):
        await asyncio.sleep(0)


def read_source_url(url: str, storage_options: Mapping[str, Any] | None) -> bytes | None:
    """The bytes of the object at ``url`` when it is a source list file; None when it is an HDF5
    file (blocking: at construction). Raises :class:`SourceError` naming the URL."""
    with contextlib.closing(RemoteSource(storage_options)) as source:
        return source._run(source._read_list(url))


# --- the store of each protocol --------------------------------------------------------------


def make_store(url: str, options: Mapping[str, Any], pool: Executor, transfer: Transfer) -> Store:
    """The store for ``url``'s protocol (on the source's loop: an async filesystem is created
    inside it). S3 goes through obstore where :mod:`._obstore` says it may, else s3fs."""
    match = SCHEME.match(url)
    assert match is not None
    protocol = match.group(1).lower()
    if protocol in ("s3", "s3a"):
        store = _obstore_store(options, transfer)
        if store is not None:
            return store
    import fsspec  # type: ignore[import-untyped]

    cls = fsspec.get_filesystem_class(protocol)
    s3 = "s3" in (cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,))
    kw = s3_options(options, transfer.requests) if s3 else dict(options)
    if getattr(cls, "async_impl", False):
        fs = cls(asynchronous=True, skip_instance_cache=True, **kw)
        return S3Store(fs) if s3 else FsspecStore(fs, pool)
    return FsspecStore(cls(skip_instance_cache=True, **kw), pool)


def s3_options(options: Mapping[str, Any], requests: int) -> dict[str, Any]:
    """``storage_options`` for s3fs, with our defaults where the user set none: no retries of
    botocore's (ours are counted and bounded), and a connection per request in flight."""
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("max_pool_connections", requests)
    out["config_kwargs"] = config
    return out


def _obstore_store(options: Mapping[str, Any], transfer: Transfer) -> Store | None:
    """The obstore S3 store, or None where s3fs reads (``ASYNCHDF5_S3_CLIENT``: see
    :mod:`._obstore`)."""
    choice = os.environ.get(CLIENT_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in ("auto", "obstore", "s3fs"):
        raise ValueError(f"{CLIENT_VARIABLE}={choice!r}: expected 'auto', 'obstore' or 's3fs'")
    if choice == "s3fs":
        return None
    try:
        return ObstoreS3(obstore_settings(options, transfer, strict=choice == "auto"))
    except NotTranslated as exc:
        if choice == "obstore":
            raise ValueError(
                f"{CLIENT_VARIABLE}=obstore, but obstore cannot do what s3fs would with {exc}"
            ) from None
    except ImportError:
        if choice == "obstore":
            raise
    return None
