"""The fetches of a remote source: the ranges of one fetch grouped by object, cut into units
(through the remote cache's blocks where there is one), fetched concurrently and handed to their
buffers or to the codec threads."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import anyio

from ..._errors import ReadError
from ..._stats import ReadStats
from .._base import ByteRange, Streaming
from .._local import LocalSource
from ._errors import ObjectChanged
from ._fetch import Unit, assign, gather_all, settle, spans, wrap_error
from ._files import RemoteFile
from ._requests import Requests


class Fetcher(Requests):
    """:meth:`fetch` of a :class:`~._source.RemoteSource` (its base class, over its
    :class:`~._requests.Requests`)."""

    # Set by RemoteSource.__init__.
    cache_hits: int
    cache_misses: int
    _local: LocalSource
    _pool: ThreadPoolExecutor | None

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
        if len(remote) < len(ranges):
            local = [r for r in ranges if not isinstance(r.file, RemoteFile)]
            if not remote:
                return await self._local.fetch(local, work, limiter, stats, streaming=streaming)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    functools.partial(self._local.fetch, streaming=streaming),
                    local,
                    work,
                    limiter,
                    stats,
                )
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
