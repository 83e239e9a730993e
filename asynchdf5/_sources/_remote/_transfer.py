"""How a remote source moves bytes: its settings (:class:`Transfer`: sizes, bounds, retries,
timeouts), the event loop its requests run on (:class:`LoopThread`), and what bounds and gathers
them there (:class:`Buffers`, :func:`gather_all`, :func:`settle`)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import random
import threading
import weakref
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.to_thread

from ..._errors import DataLayerError

T = TypeVar("T")


@dataclass(frozen=True)
class Transfer:
    """How a remote source moves bytes (the module's :data:`TRANSFER`, read when a source is
    created)."""

    #: Bytes of one request at most: longer runs are cut into parts fetched concurrently.
    part_bytes: int = 8 * 2**20
    #: Ranges of one object less than this apart are fetched by one request (the gap is dropped):
    #: a request costs a round trip, a few hundred KiB cost less on any link worth streaming from.
    gap_bytes: int = 256 * 2**10
    #: Requests in flight per source.
    requests: int = 16
    #: Bytes held in buffers per source: raw chunks waiting to be decoded, blocks of the remote
    #: cache (bytes bound for the cache slot go straight there).
    bytes_in_flight: int = 128 * 2**20
    #: Tries of one request before it is a ReadError (transient errors only).
    attempts: int = 6
    #: Wait before the first retry (seconds); doubled for each next one, up to ``max_backoff``,
    #: times a random factor in [0.5, 1.5) so that ranks that failed together retry apart.
    backoff: float = 0.2
    max_backoff: float = 5.0
    #: One try of one request, at most (seconds): a stalled connection is a transient error.
    timeout: float = 60.0
    #: h5py's reads (metadata at open, the h5py read path) are fetched in blocks of this size,
    #: the last ``metadata_blocks`` of them kept per open file.
    metadata_block: int = 256 * 2**10
    metadata_blocks: int = 16
    #: remote_cache: objects are cached in blocks of this size.
    cache_block: int = 8 * 2**20

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1, 2, ...)."""
        wait = min(self.max_backoff, self.backoff * 2.0 ** (attempt - 1))
        return float(wait * random.uniform(0.5, 1.5))


#: The transfer settings new sources take.
TRANSFER = Transfer()


def default_transfer() -> Transfer:
    """:data:`TRANSFER` as it is now (read at each call, so that replacing it takes effect)."""
    return TRANSFER


class LoopThread:
    """An asyncio event loop in a thread of its own: one source's requests and sockets.

    Loops still running when the interpreter exits (a layer never closed) are stopped by an
    ``atexit`` hook, which cancels their requests first: obstore's threads deliver an answer by
    calling into the loop, and one doing so while the interpreter finalizes can abort the process.
    """

    _running: ClassVar[weakref.WeakSet[LoopThread]] = weakref.WeakSet()

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        LoopThread._running.add(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (blocking; a worker thread, never the
        loop's own)."""
        assert threading.current_thread() is not self._thread
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop; wait for it without blocking the caller's event loop (any
        anyio backend). Cancelling the caller cancels ``coro`` and returns once it has ended."""
        finished = threading.Event()

        async def run() -> T:
            try:
                return await coro
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            await anyio.to_thread.run_sync(
                concurrent.futures.wait, [future], abandon_on_cancel=True
            )
        except BaseException:
            future.cancel()  # the task on our loop: its requests are dropped, their sockets closed
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(finished.wait)
            raise
        return future.result()

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what still runs, stop the loop and join its thread (blocking; at most about
        ``timeout`` seconds for each, if given: the loop is then left to the process's end)."""

        async def shutdown() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        LoopThread._running.discard(self)
        if self.loop.is_closed():
            return
        assert threading.current_thread() is not self._thread
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()


@atexit.register
def _stop_running_loops() -> None:
    for loop in list(LoopThread._running):
        with contextlib.suppress(Exception):  # exiting: nothing left to tell
            loop.stop(timeout=5.0)


# --- on the loop ---------------------------------------------------------------------------


class Buffers:
    """Reusable buffers of ``size`` bytes, at most ``count`` of them (used on the source's loop
    only). Bytes that must stop in memory on their way (raw chunks to decode, blocks for the
    remote cache) land in one, which bounds the bytes held in flight; reusing them spares each
    request fresh pages, whose first touch is slow on some machines (slower than the network)."""

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
