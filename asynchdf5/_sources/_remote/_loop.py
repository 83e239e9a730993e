"""The event loop of a remote source, in a thread of its own."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


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
