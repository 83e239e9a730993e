"""The fetching of a remote source: ranged reads, coalesced, concurrent and retried.

A :class:`Fetcher` runs every request of one source on the source's own event loop
(:class:`~._transfer.LoopThread`), at most ``requests`` at a time, each retried while its error
is transient. One fetch groups its ranges by object, coalesces those closer than ``gap_bytes``
and cuts the runs into parts of at most ``part_bytes`` (:func:`spans`), or into the remote
cache's blocks where there is one; each part is one request (a :class:`Unit`). Bytes bound for
a cache slot are copied there as the body arrives (one copy); raw chunks to decode land in
reused buffers (:class:`Buffers`, ``bytes_in_flight`` of them at most) and go to the layer's
codec threads. After the reads, objects whose store does not make every read conditional are
checked against the version recorded at open.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..._errors import ReadError, SourceError
from ..._stats import ReadStats
from .._base import ByteRange
from ._errors import ObjectChanged, Secrets, check_length, classify, decode_error, read_error
from ._files import RemoteFile
from ._transfer import Buffers, LoopThread, Transfer, gather_all, settle

if TYPE_CHECKING:
    from ._cache import DiskCache

T = TypeVar("T")


class Sink:
    """Where the bytes of one range go as parts of it arrive."""

    __slots__ = ("buf", "left", "range", "view")

    def __init__(self, r: ByteRange) -> None:
        self.range = r
        self.left = r.size
        self.buf: bytearray | None = None
        self.view = None if r.into is None else r.into.cast("B") if r.into.format != "B" else r.into

    def put(self, at: int, data: memoryview) -> memoryview | None:
        """Bytes ``at:at + len(data)`` of the range; its whole bytes (for ``then``) once they
        are all in."""
        r = self.range
        if self.view is not None:
            self.view[at : at + len(data)] = data
        elif len(data) == r.size:
            self.left = 0
            return data  # the whole range in one part: no copy
        else:
            if self.buf is None:
                self.buf = bytearray(r.size)
            self.buf[at : at + len(data)] = data
        self.left -= len(data)
        if self.left > 0:
            return None
        return self.view if self.view is not None else memoryview(self.buf or b"")


@dataclass(eq=False)
class Unit:
    """One request's worth of a fetch: bytes ``start:stop`` of ``file``, for ``sinks``."""

    file: RemoteFile
    start: int
    stop: int
    sinks: list[Sink] = field(default_factory=list)
    cache_key: str | None = None  # fetched through the remote cache, as this block

    @property
    def about(self) -> str:
        seen = dict.fromkeys(s.range.about.split(": stored chunk")[0] for s in self.sinks)
        names = list(seen)
        more = f" (and {len(names) - 2} more)" if len(names) > 2 else ""
        return "; ".join(names[:2]) + more


def spans(ranges: Sequence[ByteRange], part: int, gap: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted by offset) coalesced into runs where less than ``gap`` bytes apart,
    the runs cut into parts of at most ``part`` bytes, of about equal size (finer parts are no
    faster: each request costs the client CPU of its own)."""
    runs: list[list[int]] = []
    for r in ranges:
        a, b = r.offset, r.offset + r.size
        if runs and a <= runs[-1][1] + gap:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    out = []
    for a, b in runs:
        n = -(-(b - a) // part)
        step = -(-(b - a) // n)
        out += [(p, min(b, p + step)) for p in range(a, b, step)]
    return out


def assign(
    file: RemoteFile, ranges: Sequence[ByteRange], spans: Sequence[tuple[int, int]]
) -> list[Unit]:
    """A unit per span, with the sinks of the ranges it overlaps (``ranges`` sorted by offset,
    spans sorted and disjoint, together covering every range)."""
    units = [Unit(file, a, b) for a, b in spans]
    starts = [a for a, _ in spans]
    for r in ranges:
        sink = Sink(r)
        i = max(0, bisect.bisect_right(starts, r.offset) - 1)
        while i < len(units) and units[i].start < r.offset + r.size:
            if units[i].stop > r.offset:
                units[i].sinks.append(sink)
            i += 1
    return [u for u in units if u.sinks]


class Fetcher:
    """Every request of one remote source: on the loop of its own thread (started here, so made
    in a worker thread), with its pool for blocking calls (filesystems without an async
    implementation, the remote cache's files), its bounds, and its counters (for tests and
    benchmarks: requests sent, bytes received, retries, remote cache hits and misses)."""

    def __init__(self, transfer: Transfer, scrub: Secrets, cache: DiskCache | None) -> None:
        self.transfer = transfer
        self.scrub = scrub
        self.cache = cache
        self.pool = ThreadPoolExecutor(4, "asynchdf5-remote-io")
        self._loop: LoopThread | None = LoopThread("asynchdf5-remote")
        # asyncio's primitives bind to the loop that first waits on them: the source's.
        self._sem = asyncio.Semaphore(transfer.requests)
        size = max(transfer.part_bytes, transfer.cache_block if cache is not None else 0)
        self._buffers = Buffers(transfer.bytes_in_flight // size, size)
        self.requests = self.bytes_fetched = self.retries = 0
        self.cache_hits = self.cache_misses = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (blocking: a worker thread)."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise SourceError("the source is closed")
        return loop.run(coro)

    def close(self, last: Coroutine[Any, Any, None]) -> None:
        """Run ``last`` on the loop (closing the stores), then stop the loop and the pool
        (blocking)."""
        loop, self._loop = self._loop, None
        if loop is None:
            last.close()
            return
        try:
            loop.run(last)
        finally:
            loop.stop()
            self.pool.shutdown(wait=True)

    # --- requests ----------------------------------------------------------------------------

    async def retry(
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

    def _failed(self, file: RemoteFile, about: str, exc: BaseException) -> ReadError:
        return read_error(file.name, about, exc, self.transfer.attempts, self.scrub)

    async def _get(self, file: RemoteFile, start: int, stop: int, about: str) -> bytes:
        """Bytes ``start:stop`` of ``file``, retried; a ReadError naming ``about`` else."""
        async with self._sem:
            try:
                data = await self.retry(
                    lambda: file.store.get(file.url, start, stop, file.version), None
                )
            except Exception as exc:
                raise self._failed(file, about, exc) from None
        self.bytes_fetched += len(data)
        check_length(file.name, about, start, stop, len(data))
        return data

    async def _stream(self, u: Unit, into: memoryview | None, stats: ReadStats) -> None:
        """The unit's bytes, retried: into ``into`` (a buffer of the unit's size), or, if None,
        straight into its sinks' buffers (for ranges bound for the cache slot)."""

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
                n = await self.retry(
                    lambda: file.store.stream(file.url, u.start, u.stop, file.version, put), stats
                )
            except Exception as exc:
                raise self._failed(file, u.about, exc) from None
        self.bytes_fetched += n
        check_length(file.name, u.about, u.start, u.stop, n)

    def read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of ``file`` (blocking: h5py's reads, from a worker thread)."""
        return self.run(self._get(file, start, stop, f"bytes {start}:{stop}"))

    def read_into(self, file: RemoteFile, start: int, view: memoryview) -> None:
        """``len(view)`` bytes of ``file`` from ``start`` into ``view``, in concurrent parts
        (blocking)."""
        n = len(view)
        step = -(-n // -(-n // self.transfer.part_bytes))

        async def part(a: int) -> None:
            b = min(n, a + step)
            p, q = start + a, start + b
            view[a:b] = await self._get(file, p, q, f"bytes {p}:{q}")

        async def parts() -> None:
            await gather_all(asyncio.ensure_future(part(a)) for a in range(0, n, step))

        self.run(parts())

    def check(self, file: RemoteFile) -> None:
        """Raise a ReadError if ``file`` changed or vanished since it was opened (blocking)."""
        loop = self._loop
        if loop is None:
            raise ReadError(f"{file.name}: the source is closed")
        loop.run(self._check(file, None))

    async def _check(self, file: RemoteFile, stats: ReadStats | None, about: str = "") -> None:
        where = f"{file.name}: {about}: " if about else f"{file.name}: "
        try:
            size, version = await self.retry(lambda: file.store.head(file.url), stats)
        except Exception as exc:
            if classify(exc) == "missing":
                raise ObjectChanged(
                    f"{where}the object was deleted after the source was opened"
                ) from None
            raise self._failed(file, about or "cannot check the object", exc) from None
        if size != file.size or version != file.version:
            before = ", ".join(f"{k} {v}" for k, v in sorted(file.version.items()))
            after = ", ".join(f"{k} {v}" for k, v in sorted(version.items()))
            raise ObjectChanged(
                f"{where}the object was changed after the source was opened "
                f"({file.size} bytes, {before} -> {size} bytes, {after})"
            )

    # --- fetches -----------------------------------------------------------------------------

    async def fetch(self, ranges: Sequence[ByteRange], work: Executor, stats: ReadStats) -> None:
        """Every range of ``ranges`` (of remote objects only), on the loop, waited for without
        blocking the caller's event loop (see :meth:`.._base.Source.fetch`)."""
        loop = self._loop
        if loop is None:
            raise ReadError("the remote source is closed")
        await loop.call(self._fetch(ranges, work, stats))

    def _units(self, file: RemoteFile, ranges: list[ByteRange]) -> list[Unit]:
        group = sorted((r for r in ranges if r.size > 0), key=lambda r: r.offset)
        cache = self.cache
        key = cache.key(file) if cache is not None else None
        if cache is None or key is None:
            t = self.transfer
            return assign(file, group, spans(group, t.part_bytes, t.gap_bytes))
        b = cache.block
        blocks = {k for r in group for k in range(r.offset // b, (r.offset + r.size - 1) // b + 1)}
        units = assign(file, group, [(k * b, min(file.size, (k + 1) * b)) for k in sorted(blocks)])
        for u in units:
            u.cache_key = key
        return units

    async def _fetch(self, ranges: Sequence[ByteRange], work: Executor, stats: ReadStats) -> None:
        by_file: dict[int, list[ByteRange]] = {}
        for r in ranges:
            by_file.setdefault(id(r.file), []).append(r)
        groups = list(by_file.values())
        files = [_remote(g[0]) for g in groups]
        units = [u for f, g in zip(files, groups, strict=True) for u in self._units(f, g)]
        # Empty ranges have nothing to wait for.
        futures: list[Future[None]] = [
            work.submit(r.then, r.into if r.into is not None else b"")
            for r in ranges
            if r.size == 0 and r.then is not None
        ]
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
        loop = asyncio.get_running_loop()
        buf = await self._buffers.acquire()
        try:
            data = memoryview(buf)[: u.stop - u.start]
            cache = self.cache
            hit = False
            if cache is not None and u.cache_key is not None:
                index = u.start // cache.block
                hit = await loop.run_in_executor(
                    self.pool, cache.read_into, u.cache_key, index, data
                )
                if hit:
                    self.cache_hits += 1
                else:
                    self.cache_misses += 1
            if not hit:
                await self._stream(u, data, stats)
            mine = _deliver(u, data.toreadonly(), work)
            futures += mine
            if cache is not None and u.cache_key is not None and not hit:
                await loop.run_in_executor(self.pool, cache.write, u.cache_key, index, data)
            if mine:
                # The buffer is reused once its bytes are decoded (a ``then`` holds no view of
                # them past its call).
                await settle(mine)
                for f in mine:
                    exc = f.exception()
                    if exc is not None:
                        raise decode_error(exc, u.file.name, u.about)
        finally:
            await self._buffers.release(buf)


def _remote(r: ByteRange) -> RemoteFile:
    assert isinstance(r.file, RemoteFile)
    return r.file


def _deliver(u: Unit, view: memoryview, work: Executor) -> list[Future[None]]:
    """The unit's bytes to its sinks; a decode submitted for each range now whole."""
    out = []
    for sink in u.sinks:
        r = sink.range
        lo, hi = max(u.start, r.offset), min(u.stop, r.offset + r.size)
        whole = sink.put(lo - r.offset, view[lo - u.start : hi - u.start])
        if whole is not None and r.then is not None:
            out.append(work.submit(r.then, whole))
    return out
