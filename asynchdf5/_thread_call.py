"""A worker thread's call that no cancellation cuts short (:func:`run_sync_whole`).

anyio's ``to_thread.run_sync`` shields its wait from anyio's cancellations, but on asyncio a
native ``Task.cancel()`` (what the runner does on Ctrl-C) goes through any shield: the task
stops waiting while the thread goes on, and what the thread returns is lost. A call that
returns something to release (a lease, an open file), or one whose inputs the caller closes
when it fails, must be waited for to its end: here the wait runs in a task of its own, which a
native cancellation of the caller does not reach, and the caller's task group waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

__all__ = ["run_sync_whole"]

T = TypeVar("T")


async def run_sync_whole(
    fn: Callable[..., T], *args: object, release: Callable[[T], object] | None = None
) -> T:
    """``fn(*args)`` in a worker thread, waited for to its end even when the caller is
    cancelled (natively too); then the cancellation goes on, and what ``fn`` returned is
    given to ``release`` (blocking, on the event loop: keep it short). What ``fn`` raises is
    raised as it is (never wrapped in an ExceptionGroup)."""
    done: list[T] = []
    failed: list[Exception] = []

    async def call() -> None:
        try:
            done.append(await anyio.to_thread.run_sync(fn, *args))
        except Exception as exc:  # raised below, in the caller's task, unwrapped
            failed.append(exc)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
    except BaseException:
        if done and release is not None:
            release(done[0])
        raise
    if failed:
        raise failed[0]
    return done[0]
