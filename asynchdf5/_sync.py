"""The bridge of the sync side of the layers (``with`` / ``for``): an event loop in a background
thread and its portal.

A layer opened with ``with`` holds a :class:`Bridge`: an event loop in a background thread and
its anyio blocking portal (one per opening, on asyncio: a :class:`LoopPortal`), through which
the layer enters and exits its own async opening. Every call crosses that one bridge: opening
and closing, and iterating (a ``for`` loop's :class:`~._iterator.EpochIterator` takes at most
:data:`BRIDGE_BATCHES` batches that are already gathered per trip, through
:func:`call_or_cancel`). The trips of a ``for`` loop go to the loop as asyncio tasks of their
own, in one hand-off each way (anyio's ``start_task_soon`` waits for the loop to spawn the task:
a hand-off more, and its task group's bookkeeping, which made a trip about twice as dear). This
module knows no layer, consumer or iterator and is handed none of their code: it starts and
stops the loop, and control goes one way.

Ctrl-C never leaves the bridge's thread running with nobody to stop it: closing asks the loop to
stop with ``KeyboardInterrupt`` held back until the request is queued (a second Ctrl-C during
the close cannot split it), and waits for the thread only once it was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import CancelledError, Future
from types import FrameType
from typing import Any, Generic, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

__all__ = ["BRIDGE_BATCHES", "Bridge", "LoopPortal", "call_or_cancel", "interrupts_held"]

T = TypeVar("T")

#: Batches taken per trip across the bridge, at most (only those gathered already): a trip costs
#: about a tenth of a millisecond, so tiny batches must share it (a group's most).
BRIDGE_BATCHES = 256


class LoopPortal(BlockingPortal):
    """anyio's blocking portal that knows its asyncio event loop (made in that loop), so that
    :func:`call_or_cancel` can hand calls to the loop directly, and the loop's context, which
    those calls run in (not the caller's: a caller inside ``trio.run`` carries sniffio's
    "trio" in its context, and anyio would take the bridge's tasks for trio's)."""

    def __init__(self) -> None:
        super().__init__()
        #: The event loop the portal serves (it was made there).
        self.loop = asyncio.get_running_loop()
        #: The loop's context: each call's task starts in a copy of it.
        self.context = contextvars.copy_context()


class Bridge:
    """An event loop in a daemon thread, serving a blocking portal until :meth:`stop`.

    anyio's ``start_blocking_portal`` waits for its thread in a ``finally``, even when a
    ``KeyboardInterrupt`` came before the loop was asked to stop: the wait never ended. Here the
    request is made with Ctrl-C held back, and the wait comes only after it.
    """

    def __init__(self) -> None:
        started: Future[LoopPortal] = Future()

        async def serve() -> None:
            async with LoopPortal() as portal:
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


class _Call(Generic[T]):
    """One call across the bridge: ``fn(*args)`` run on the loop as an asyncio task of its own,
    its outcome in :attr:`result`; :attr:`ended` is set once the task is over, or once it is
    sure never to start (cancelled before)."""

    def __init__(
        self,
        portal: LoopPortal,
        fn: Callable[..., Coroutine[Any, Any, T]],
        args: Any,
    ) -> None:
        self.result: Future[T] = Future()
        self.ended = threading.Event()
        self._loop, self._context, self._fn, self._args = portal.loop, portal.context, fn, args
        self._task: asyncio.Task[T] | None = None

    def start(self) -> None:
        """On the loop: start the task (unless :meth:`cancel` came first)."""
        if not self.result.set_running_or_notify_cancel():
            self.ended.set()
            return
        self._task = self._loop.create_task(self._fn(*self._args))
        self._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[T]) -> None:
        self.ended.set()  # first: a caller that has the outcome never waits for this
        if task.cancelled():
            self.result.set_exception(CancelledError())
        elif (exc := task.exception()) is not None:
            self.result.set_exception(exc)
        else:
            self.result.set_result(task.result())

    def cancel(self) -> None:
        """From the caller's thread: the call never starts (and is over at once: it may never
        have been handed to the loop, when the interrupt came before the hand-off, so nothing
        there would ever say so), or its task is cancelled (it ends at its next await)."""
        if self.result.cancel():  # not started, and now never will be
            self.ended.set()
        elif not self.result.done():
            self._loop.call_soon_threadsafe(self._cancel_task)  # started: cancel its task

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _hand_to_loop(call: _Call[Any]) -> None:
    """Hand ``call`` to its loop (a function of its own: tests interrupt right after it)."""
    call._loop.call_soon_threadsafe(call.start, context=call._context.copy())


def call_or_cancel(
    portal: BlockingPortal, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any
) -> T:
    """``fn(*args)`` on the portal's loop, waited for (as ``portal.call``, in one hand-off to the
    loop and one back); but when the wait is interrupted (Ctrl-C), the call is cancelled on the
    loop and has ended before the interrupt goes on. Else it would go on waiting there for the
    consumer's next group, and take it (or, taking it from the same run as the next loop does,
    make that one fail) once the caller has moved on. ``portal`` is a :class:`Bridge`'s."""
    assert isinstance(portal, LoopPortal), "a layer's portal is its bridge's"
    call = _Call(portal, fn, args)
    try:
        # Held while the call is handed to the loop: an interrupt there would leave it unknown
        # whether the loop has it.
        with interrupts_held():
            _hand_to_loop(call)
        return call.result.result()
    except BaseException:
        call.cancel()
        with interrupts_held():
            call.ended.wait(CANCEL_WAIT_S)
        raise
