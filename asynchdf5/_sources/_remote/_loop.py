"""The event loop of a remote source, in a thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop in a thread of its own: one source's requests and sockets."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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

    def stop(self) -> None:
        """Cancel what still runs, stop the loop and join its thread (blocking)."""

        async def shutdown() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        try:
            self.run(shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
