"""Worker-thread calls that no cancellation cuts short (:func:`run_sync_whole`,
:func:`release_whole`).

anyio's ``to_thread.run_sync`` shields its wait from anyio's cancellations, but on asyncio a
native ``Task.cancel()`` (what the runner does on Ctrl-C, and ``asyncio.timeout``) goes through
any shield: the task stops waiting while the thread goes on, and what the thread returns is
lost; a cancel that lands before the thread starts means it never runs. A call that returns
something to release (a lease, an open file, a process), or one whose inputs the caller closes
or frees when it fails, must be waited for to its end: here the wait runs in a task of its own,
which a native cancellation of the caller does not reach, and the caller's task group waits
for it. A release (closing files, freeing the cache, reaping a process) must also be made
when the cancel came first: :func:`release_whole`.

A native cancel reaches only the task it is sent to: the user's (opening, ``async for``,
closing). The stages' tasks in an open layer's task group are cancelled through anyio's scopes
alone, which honour ``to_thread.run_sync``'s shield: their calls always run whole, and use it
directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

__all__ = ["release_whole", "run_sync_whole"]

T = TypeVar("T")


async def run_sync_whole(
    fn: Callable[..., T], *args: object, release: Callable[[T], object] | None = None
) -> T:
    """``fn(*args)`` in a worker thread, waited for to its end even when the caller is
    cancelled (natively too); then the cancellation goes on, and what ``fn`` returned is
    given to ``release`` (blocking, on the event loop: keep it short). A cancellation that
    comes before the thread starts leaves ``fn`` unmade. What ``fn`` raises is raised as it is
    (never wrapped in an ExceptionGroup)."""
    return await _whole(fn, args, release, always=False)


async def release_whole(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)``, a release, in a worker thread: made even when the caller was cancelled
    before it started, and waited for to its end whatever cancels the caller; then the
    cancellation goes on. Without it, the caller could leave while its files are still being
    closed (or never closed), or its memory freed under a thread still using it."""
    await _whole(fn, args, None, always=True)


async def _whole(
    fn: Callable[..., T],
    args: tuple[object, ...],
    release: Callable[[T], object] | None,
    *,
    always: bool,
) -> T:
    done: list[T] = []
    failed: list[Exception] = []

    async def call() -> None:
        try:
            with anyio.CancelScope(shield=always):
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
