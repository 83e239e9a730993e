"""The requests of a remote source: each one retried, a failed one turned into the error that
names the file, the check that an object is unchanged, and the blocking reads of h5py's file
object."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..._errors import ReadError
from ..._stats import ReadStats
from ._cache import DiskCache
from ._errors import Changed, ObjectChanged, Secrets, classify, describe
from ._fetch import Buffers, Unit, gather_all
from ._files import RemoteFile
from ._loop import LoopThread
from ._transfer import Transfer

T = TypeVar("T")


class Requests:
    """The requests of a :class:`~._source.RemoteSource`, its base class: the source holds the
    state declared here and starts the loop that the requests run on (:meth:`_start`)."""

    # Set by RemoteSource.__init__.
    transfer: Transfer
    scrub: Secrets
    cache: DiskCache | None
    requests: int
    bytes_fetched: int
    retries: int
    _loop: LoopThread | None
    _sem: asyncio.Semaphore | None
    _buffers: Buffers | None

    def _start(self) -> LoopThread:
        raise NotImplementedError

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
