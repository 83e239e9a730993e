"""The pieces of one fetch: units (one request each), their sinks, and the bounds."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..._errors import DataLayerError, ReadError
from .._base import ByteRange
from ._errors import describe
from ._files import RemoteFile


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
        seen: dict[str, None] = {}
        for s in self.sinks:
            seen.setdefault(s.range.about.split(": stored chunk")[0], None)
        names = list(seen)
        more = f" (and {len(names) - 2} more)" if len(names) > 2 else ""
        return "; ".join(names[:2]) + more


def spans(ranges: Sequence[ByteRange], part: int, gap: int) -> list[tuple[int, int]]:
    """``ranges`` (sorted by offset) coalesced into runs where less than ``gap`` bytes apart,
    the runs cut into parts of at most ``part`` bytes, of about equal size. (Measured: finer
    parts for small fetches, or parts sized to fill whole waves of requests, were no faster:
    each request costs the client a millisecond or more of CPU.)"""
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


class Buffers:
    """Reusable buffers of ``size`` bytes, at most ``count`` of them (used on the source's loop
    only). Bytes that must stop in memory on their way (raw chunks to decode, blocks for the
    remote cache) land in one, which bounds the bytes held in flight; and reusing buffers spares
    each request fresh pages, whose first touch is slow on some machines (0.2 GiB/s measured on
    this project's VMs, slower than the network)."""

    def __init__(self, count: int, size: int) -> None:
        self.count = max(1, count)
        self.size = size
        self._free: list[bytearray] = []
        self._made = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> bytearray:
        async with self._cond:
            await self._cond.wait_for(lambda: bool(self._free) or self._made < self.count)
            if self._free:
                return self._free.pop()
            self._made += 1
        return bytearray(self.size)

    async def release(self, buf: bytearray) -> None:
        async with self._cond:
            self._free.append(buf)
            self._cond.notify()


def first_error(errors: Sequence[BaseException]) -> BaseException:
    """The error to report: a named one (the object changed, a chunk that does not decode)
    before the others (cancellations of the rest, lost connections)."""
    for e in errors:
        if isinstance(e, DataLayerError):
            return e
    for e in errors:
        if not isinstance(e, asyncio.CancelledError):
            return e
    return errors[0]


def wrap_error(exc: BaseException, u: Unit) -> BaseException:
    if isinstance(exc, DataLayerError) or not isinstance(exc, Exception):
        return exc
    err = ReadError(f"{u.file.name}: {u.about}: read failed: {describe(exc)}")
    err.__cause__ = exc
    return err


async def settle(futures: Sequence[Future[Any]]) -> None:
    """Wait until none of ``futures`` (the codec threads' work) is running."""
    running = [asyncio.wrap_future(f) for f in futures if not f.done()]
    if running:
        await asyncio.wait(running)
        for w in running:
            if not w.cancelled():
                w.exception()  # seen (the concurrent future reports it), so asyncio logs nothing


async def gather_all(tasks: Iterator[asyncio.Future[Any]] | Sequence[asyncio.Future[Any]]) -> None:
    """Wait for every task; on the first error cancel the rest, wait for them, and raise it."""
    pending = list(tasks)
    if not pending:
        return
    try:
        done, rest = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        raise first_error([e for e in errors if e is not None])
