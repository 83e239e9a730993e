"""The remote source: opening objects, requests with retries, fetches, integrity checks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from ..._errors import ReadError, SourceError
from ..._stats import ReadStats
from .._base import ByteRange, StoredFile
from .._entries import HDF5_SIGNATURE, is_url
from .._local import LocalFile, LocalSource
from . import _transfer
from ._cache import DiskCache
from ._errors import SCHEME, Changed, ObjectChanged, Secrets, classify, describe, status_of
from ._fetch import Buffers, Unit, assign, gather_all, settle, spans, wrap_error
from ._files import RemoteFile
from ._loop import LoopThread
from ._stores import Store, make_store
from ._transfer import Transfer

T = TypeVar("T")


def file_url_path(url: str) -> str | None:
    """The local path of a ``file://`` URL (None for other URLs)."""
    if not url.lower().startswith("file://"):
        return None
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        return None  # a file on another host: leave it to fsspec
    return os.path.normpath(unquote(parts.path))


class RemoteSource:
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
            store = make_store(url, self._options, self._pool, self.transfer.requests)
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

    # --- requests ---------------------------------------------------------------------------

    async def _retry(
        self, attempt: Callable[[], Coroutine[Any, Any, T]], stats: ReadStats | None
    ) -> T:
        """``attempt()`` until it succeeds, a non-transient error, or the last attempt."""
        t = self.transfer
        for i in range(1, t.attempts + 1):
            try:
                self.requests += 1
                return await asyncio.wait_for(attempt(), t.timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if classify(exc) != "transient" or i == t.attempts:
                    raise
                self.retries += 1
                if stats is not None:
                    stats.retries += 1
                await asyncio.sleep(t.delay(i))
        raise AssertionError("unreachable")

    def _read_error(self, file: RemoteFile, about: str, exc: BaseException) -> ReadError:
        what = classify(exc)
        if what == "changed":
            why = "was changed after the source was opened"
            detail = f" ({exc})" if isinstance(exc, Changed) else ""
            msg = f"{file.name}: {about}: the object {why}{detail}"
        elif what == "missing":
            msg = f"{file.name}: {about}: the object was deleted after the source was opened"
        elif what == "transient":
            msg = (
                f"{file.name}: {about}: read failed after {self.transfer.attempts} attempts: "
                f"{describe(exc)}"
            )
        else:
            msg = f"{file.name}: {about}: read failed: {describe(exc)}"
        err = ReadError(self.scrub(msg))
        if not self.scrub.leaks(exc):
            err.__cause__ = exc
        err.__suppress_context__ = True
        return err

    async def _get(
        self, file: RemoteFile, start: int, stop: int, about: str, stats: ReadStats | None
    ) -> bytes:
        """Bytes ``start:stop`` of ``file``, retried; a ReadError naming ``about`` else."""
        assert self._sem is not None
        async with self._sem:
            try:
                data = await self._retry(
                    lambda: file.store.get(file.url, start, stop, file.version), stats
                )
            except Exception as exc:
                raise self._read_error(file, about, exc) from None
        self.bytes_fetched += len(data)
        if len(data) != stop - start:
            raise ReadError(
                f"{file.name}: {about}: {stop - start} bytes at offset {start} are cut short "
                f"({len(data)} came; the object is shorter than when the source was opened)"
            )
        return data

    async def _stream(self, u: Unit, into: memoryview | None, stats: ReadStats) -> None:
        """The unit's bytes, retried: into ``into`` (a buffer of the unit's size), or, if None,
        straight into its sinks' buffers (for ranges bound for the cache slot)."""
        assert self._sem is not None

        def put(at: int, piece: memoryview) -> None:
            if into is not None:
                into[at : at + len(piece)] = piece
                return
            a = u.start + at
            b = a + len(piece)
            for sink in u.sinks:
                r = sink.range
                lo, hi = max(a, r.offset), min(b, r.offset + r.size)
                if lo < hi and sink.view is not None:
                    sink.view[lo - r.offset : hi - r.offset] = piece[lo - a : hi - a]

        file = u.file
        async with self._sem:
            try:
                n = await self._retry(
                    lambda: file.store.stream(file.url, u.start, u.stop, file.version, put), stats
                )
            except Exception as exc:
                raise self._read_error(file, u.about, exc) from None
        self.bytes_fetched += n
        if n != u.stop - u.start:
            raise ReadError(
                f"{file.name}: {u.about}: {u.stop - u.start} bytes at offset {u.start} are cut "
                f"short ({n} came; the object is shorter than when the source was opened)"
            )

    def _ensure_limits(self) -> None:
        # Made on the loop, when it runs (asyncio primitives bind to their loop).
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.transfer.requests)
            t = self.transfer
            size = max(t.part_bytes, t.cache_block if self.cache is not None else 0)
            self._buffers = Buffers(t.bytes_in_flight // size, size)

    def read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of ``file`` (blocking: h5py's reads, from a worker thread)."""

        async def get() -> bytes:
            self._ensure_limits()
            return await self._get(file, start, stop, f"bytes {start}:{stop}", None)

        return self._start().run(get())

    def read_into(self, file: RemoteFile, start: int, view: memoryview) -> None:
        """``len(view)`` bytes of ``file`` from ``start`` into ``view``, in concurrent parts
        (blocking)."""
        t = self.transfer

        async def parts() -> None:
            self._ensure_limits()
            n = len(view)
            step = -(-n // -(-n // t.part_bytes))

            async def part(a: int) -> None:
                b = min(n, a + step)
                data = await self._get(
                    file, start + a, start + b, f"bytes {start + a}:{start + b}", None
                )
                view[a:b] = data

            await gather_all(asyncio.ensure_future(part(a)) for a in range(0, n, step))

        self._start().run(parts())

    def check(self, file: RemoteFile) -> None:
        """Raise a ReadError if ``file`` changed or vanished since it was opened (blocking)."""
        loop = self._loop
        if loop is None:
            raise ReadError(f"{file.name}: the source is closed")
        loop.run(self._check(file, None))

    async def _check(self, file: RemoteFile, stats: ReadStats | None, about: str = "") -> None:
        where = f"{file.name}: {about}: " if about else f"{file.name}: "
        try:
            size, version = await self._retry(lambda: file.store.head(file.url), stats)
        except Exception as exc:
            if classify(exc) == "missing":
                raise ObjectChanged(
                    f"{where}the object was deleted after the source was opened"
                ) from None
            raise self._read_error(file, about or "cannot check the object", exc) from None
        if size != file.size or version != file.version:
            before = ", ".join(f"{k} {v}" for k, v in sorted(file.version.items()))
            after = ", ".join(f"{k} {v}" for k, v in sorted(version.items()))
            raise ObjectChanged(
                f"{where}the object was changed after the source was opened "
                f"({file.size} bytes, {before} -> {size} bytes, {after})"
            )

    # --- fetch ------------------------------------------------------------------------------

    async def fetch(
        self,
        ranges: Sequence[ByteRange],
        work: Executor,
        limiter: anyio.CapacityLimiter,
        stats: ReadStats,
    ) -> int:
        remote = [r for r in ranges if isinstance(r.file, RemoteFile)]
        if len(remote) < len(ranges):
            local = [r for r in ranges if not isinstance(r.file, RemoteFile)]
            if not remote:
                return await self._local.fetch(local, work, limiter, stats)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._local.fetch, local, work, limiter, stats)
                await self._fetch_remote(remote, work, stats)
            return sum(r.size for r in ranges)
        await self._fetch_remote(remote, work, stats)
        return sum(r.size for r in ranges)

    async def _fetch_remote(
        self, ranges: Sequence[ByteRange], work: Executor, stats: ReadStats
    ) -> None:
        loop = self._loop
        if loop is None:
            raise ReadError("the remote source is closed")
        await loop.call(self._fetch(ranges, work, stats))

    async def _fetch(self, ranges: Sequence[ByteRange], work: Executor, stats: ReadStats) -> None:
        """Every range of ``ranges`` (remote files only), on the source's loop."""
        self._ensure_limits()
        by_file: dict[int, list[ByteRange]] = {}
        for r in ranges:
            by_file.setdefault(id(r.file), []).append(r)
        units: list[Unit] = []
        futures: list[Future[None]] = []
        files: list[RemoteFile] = []
        for group in by_file.values():
            file = group[0].file
            assert isinstance(file, RemoteFile)
            files.append(file)
            group = sorted((r for r in group if r.size > 0), key=lambda r: r.offset)
            key = self.cache.key(file) if self.cache is not None else None
            if key is not None and self.cache is not None:
                b = self.cache.block
                blocks = sorted(
                    {
                        k
                        for r in group
                        for k in range(r.offset // b, (r.offset + r.size - 1) // b + 1)
                    }
                )
                cached = [(k * b, min(file.size, (k + 1) * b)) for k in blocks]
                for u in assign(file, group, cached):
                    u.cache_key = key
                    units.append(u)
            else:
                units += assign(
                    file, group, spans(group, self.transfer.part_bytes, self.transfer.gap_bytes)
                )
        for r in ranges:  # empty ranges have nothing to wait for
            if r.size == 0 and r.then is not None:
                futures.append(work.submit(r.then, r.into if r.into is not None else b""))
        tasks = [asyncio.ensure_future(self._unit(u, work, stats, futures)) for u in units]
        error: BaseException | None = None
        try:
            await gather_all(tasks)
        except Exception as exc:
            error = exc
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Nothing may write into a cache slot after the fetch returns: decodes not started
            # are dropped, those running are waited for.
            for f in futures:
                f.cancel()
            await settle(futures)
        if error is None:
            error = next((e for f in futures if not f.cancelled() and (e := f.exception())), None)
        # After the reads, for stores whose reads are not conditional: catches a change before
        # or during them. On a failed read too: an object that changed is the cause to report,
        # not bytes that do not decode.
        unchecked = {id(f): f for f in files if not f.store.conditional}
        if unchecked:
            about = {id(r.file): r.about.split(": stored chunk")[0] for r in reversed(ranges)}
            checks = [self._check(f, stats, about[k]) for k, f in unchecked.items()]
            try:
                await gather_all([asyncio.ensure_future(c) for c in checks])
            except ObjectChanged:
                raise
            except Exception:
                if error is None:
                    raise
        if error is not None:
            raise error

    async def _unit(
        self, u: Unit, work: Executor, stats: ReadStats, futures: list[Future[None]]
    ) -> None:
        if u.cache_key is None and all(
            s.view is not None and s.range.then is None for s in u.sinks
        ):
            await self._stream(u, None, stats)  # straight into the cache slot
            return
        buffers = self._buffers
        assert buffers is not None
        loop = asyncio.get_running_loop()
        buf = await buffers.acquire()
        try:
            data = memoryview(buf)[: u.stop - u.start]
            cache = self.cache
            hit = False
            if cache is not None and u.cache_key is not None:
                index = u.start // cache.block
                hit = await loop.run_in_executor(
                    self._pool, cache.read_into, u.cache_key, index, data
                )
                if hit:
                    self.cache_hits += 1
                else:
                    self.cache_misses += 1
            if not hit:
                await self._stream(u, data, stats)
            mine = self._deliver(u, data.toreadonly(), work)
            futures += mine
            if cache is not None and u.cache_key is not None and not hit:
                await loop.run_in_executor(self._pool, cache.write, u.cache_key, index, data)
            if mine:
                # The buffer is reused once its bytes are decoded (a ``then`` holds no view of
                # them past its call).
                await settle(mine)
                for f in mine:
                    exc = f.exception()
                    if exc is not None:
                        raise wrap_error(exc, u)
        finally:
            await buffers.release(buf)

    @staticmethod
    def _deliver(u: Unit, view: memoryview, work: Executor) -> list[Future[None]]:
        out = []
        for sink in u.sinks:
            r = sink.range
            lo, hi = max(u.start, r.offset), min(u.stop, r.offset + r.size)
            whole = sink.put(lo - r.offset, view[lo - u.start : hi - u.start])
            if whole is not None and r.then is not None:
                out.append(work.submit(r.then, whole))
        return out


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
