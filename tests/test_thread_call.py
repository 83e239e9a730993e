"""Worker-thread calls no cancellation cuts short (``_thread_call``), against asyncio's native
``Task.cancel()``, which goes through anyio's shields: the cancel lands before the call starts,
or while it runs, and the task still ends cancelled."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

from asynchdf5._thread_call import release_whole, run_sync_whole

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _cancelled(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``body()`` in a task of its own and check that it ends cancelled."""
    task = asyncio.get_running_loop().create_task(body())
    with anyio.fail_after(10):
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_release_is_made_whole_though_the_cancel_came_first() -> None:
    """The task is cancelled before it asks for the release: the release still runs, to its
    end, before the task ends (a shielded ``to_thread.run_sync`` never starts it)."""
    made: list[str] = []

    def close() -> None:
        time.sleep(0.05)
        made.append("closed")

    async def body() -> None:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()
        with anyio.CancelScope(shield=True):
            await release_whole(close)

    await _cancelled(body)
    assert made == ["closed"]


async def test_a_release_cancelled_while_it_runs_is_waited_for() -> None:
    made: list[str] = []
    loop = asyncio.get_running_loop()

    async def body() -> None:
        me = asyncio.current_task()
        assert me is not None

        def close() -> None:
            loop.call_soon_threadsafe(me.cancel)  # lands while this thread runs
            time.sleep(0.05)
            made.append("closed")

        with anyio.CancelScope(shield=True):
            await release_whole(close)

    await _cancelled(body)
    assert made == ["closed"]


async def test_a_result_a_cancel_would_lose_is_released() -> None:
    """A cancel lands while the call runs: the call ends, then what it returned is released
    (a lease, a process ...), and the task ends cancelled."""
    released: list[object] = []
    loop = asyncio.get_running_loop()
    thing = object()

    async def body() -> None:
        me = asyncio.current_task()
        assert me is not None

        def acquire() -> object:
            loop.call_soon_threadsafe(me.cancel)
            time.sleep(0.05)
            return thing

        await run_sync_whole(acquire, release=released.append)

    await _cancelled(body)
    assert released == [thing]


async def test_a_call_cancelled_before_it_starts_is_not_made() -> None:
    """Only a release is made after the cancel: anything else (building a catalog) is not
    started for a task that is leaving."""
    started = threading.Event()

    async def body() -> None:
        me = asyncio.current_task()
        assert me is not None
        me.cancel()
        await run_sync_whole(started.set)

    await _cancelled(body)
    assert not started.is_set()


async def test_errors_come_out_unwrapped() -> None:
    def fails() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        await release_whole(fails)
    with pytest.raises(OSError, match="disk gone"):
        await run_sync_whole(fails)
