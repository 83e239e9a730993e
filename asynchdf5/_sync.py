"""The bridge of the sync side of the layers (``with`` / ``for``): an event loop in a background
thread and its portal.

A layer opened with ``with`` holds a :class:`Bridge`: an event loop in a background thread and
its anyio blocking portal (one per opening, on asyncio), through which the layer enters and
exits its own async opening. Every call crosses that one bridge: opening and closing, and
iterating (a ``for`` loop's :class:`~._iterator.EpochIterator` takes at most
:data:`BRIDGE_BATCHES` batches that are already gathered per trip, through
:func:`call_or_cancel`). This module knows no layer, consumer or iterator and is handed none of
their code: it starts and stops the loop, and control goes one way.

Ctrl-C never leaves the bridge's thread running with nobody to stop it: closing asks the loop to
stop with ``KeyboardInterrupt`` held back until the request is queued (a second Ctrl-C during
the close cannot split it), and waits for the thread only once it was asked.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from types import FrameType
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

__all__ = ["BRIDGE_BATCHES", "Bridge", "call_or_cancel", "interrupts_held"]

T = TypeVar("T")

#: Batches taken per trip across the bridge, at most (only those gathered already): a trip costs
#: about a tenth of a millisecond, so tiny batches must share it (a group's most).
BRIDGE_BATCHES = 256


class Bridge:
    """An event loop in a daemon thread, serving a blocking portal until :meth:`stop`.

    anyio's ``start_blocking_portal`` waits for its thread in a ``finally``, even when a
    ``KeyboardInterrupt`` came before the loop was asked to stop: the wait never ended. Here the
    request is made with Ctrl-C held back, and the wait comes only after it.
    """

    def __init__(self) -> None:
        started: Future[BlockingPortal] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                started.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)  # asyncio: nothing of the caller's runs on this loop
            except BaseException as exc:  # reported to __init__ if the loop never started
                if not started.done():
                    started.set_exception(exc)

        self._thread = threading.Thread(target=run, name="asynchdf5-asyncio-bridge", daemon=True)
        portal = None
        try:
            with interrupts_held():  # the thread is started and serving, or this raises
                self._thread.start()
                portal = started.result()
        except BaseException:  # a Ctrl-C held back meanwhile: nobody else could stop the loop
            if portal is not None:
                self.portal = portal
                self.stop(cancel=True)
            raise
        self.portal = portal

    def stop(self, *, cancel: bool) -> None:
        """Ask the loop to stop (cancelling what still runs there if ``cancel``), then wait.

        The request is queued before any ``KeyboardInterrupt`` can leave; the wait is for a loop
        that is ending, so a Ctrl-C during it leaves nothing that needs another one.
        """
        with interrupts_held(), contextlib.suppress(RuntimeError):  # RuntimeError: stopped
            self.portal.call(self.portal.stop, cancel)
        self._thread.join()


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold back SIGINT in the block and deliver it (to the handler it had) once it ends.

    Only the main thread receives SIGINT, and only a handler written in Python can be held:
    elsewhere this does nothing. The block must be short; the loop it talks to never blocks.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


#: How long an interrupted call across the bridge may take to end once cancelled (it ends at
#: its next await; more means the loop itself is stuck, and the caller goes on without it).
CANCEL_WAIT_S = 10.0


def call_or_cancel(portal: BlockingPortal, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``portal.call(fn, *args)``; but when the wait is interrupted (Ctrl-C), the call is
    cancelled on the loop and has ended before the interrupt goes on. Else it would go on
    waiting there for the consumer's next group, and take it (or, taking it from the same run
    as the next loop does, make that one fail) once the caller has moved on."""
    done = threading.Event()

    async def call() -> T:
        try:
            return await fn(*args)
        finally:
            done.set()

    future: Future[T] | None = None
    try:
        # Held while the call is handed to the loop (which waits for the loop to start it): an
        # interrupt there would leave the call running with no future here to cancel it.
        with interrupts_held():
            future = portal.start_task_soon(call)
        return future.result()
    except BaseException:
        if future is not None and future.cancel():  # still running: it ends at its next await
            with interrupts_held():
                done.wait(CANCEL_WAIT_S)
        raise
