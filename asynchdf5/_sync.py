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
the close cannot split it), and waits for the thread only once it was asked. Nor does it leave
the loop blocked: the caller waits for the loop with Ctrl-C held back (:func:`_wait`), since a
``KeyboardInterrupt`` raised in a wait can leave the lock of the future waited on held (raised
as ``threading.Condition.__enter__`` returns), and the loop, setting that future, blocked on it
for ever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError, Future
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._interrupts import interrupts_held, raise_held

__all__ = [
    "BRIDGE_BATCHES",
    "Bridge",
    "EnteredOnLoop",
    "LoopPortal",
    "call_or_cancel",
]

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
        #: The tasks of the calls across the bridge that have not ended (held here: the loop
        #: holds its tasks only weakly; cancelled by ``stop(cancel=True)``).
        self.calls: set[asyncio.Task[Any]] = set()

    async def stop(self, cancel: bool = False) -> None:
        """anyio's ``stop``, which cancels the calls' tasks too if ``cancel`` (they are not in
        the portal's task group); the loop waits for them as it ends."""
        if cancel:
            for task in self.calls:
                if task is not asyncio.current_task():  # this stop may be a call of its own
                    task.cancel()
        await super().stop(cancel)


class Bridge:
    """An event loop in a daemon thread, serving a blocking portal until :meth:`stop`.

    anyio's ``start_blocking_portal`` waits for its thread in a ``finally``, even when a
    ``KeyboardInterrupt`` came before the loop was asked to stop: the wait never ended. Here the
    request is made with Ctrl-C held back, and the wait comes only after it.
    """

    def __init__(
        self,
        manager: Callable[[BlockingPortal], AbstractAsyncContextManager[Any]] | None = None,
        *,
        keep: Callable[[Bridge], object] | None = None,
    ) -> None:
        """Start the loop and, with ``manager``, enter ``manager(portal)`` there (its error, if
        entering fails, is raised here, the loop stopped; :meth:`close` leaves it). ``keep``
        is handed the bridge before anything starts: its owner holds it whatever comes next."""
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
        self._entered: EnteredOnLoop | None = None
        self._serving = False  # the loop is started (and not stopped yet)
        with interrupts_held():
            if keep is not None:
                keep(self)
            try:
                self._thread.start()
                self.portal = started.result()  # not cut short: the loop serves, or it failed
                self._serving = True
                if manager is not None:
                    entered = EnteredOnLoop(self.portal, manager(self.portal))
                    entered.enter()
                    self._entered = entered
                raise_held()  # a Ctrl-C that came meanwhile: raised where the loop stops for it
            except BaseException:  # nobody else could stop the loop
                self.stop(cancel=True)
                raise

    def close(self) -> None:
        """Leave what was entered, then stop the loop (once: a second close does nothing). A
        Ctrl-C during the close cuts the leaving short (what still runs on the loop is
        cancelled) but never the stop."""
        with interrupts_held():
            entered, self._entered = self._entered, None
            left = False
            try:
                if entered is not None:
                    entered.exit()
                left = True
            finally:
                self.stop(cancel=not left)

    def stop(self, *, cancel: bool) -> None:
        """Ask the loop to stop (cancelling what still runs there if ``cancel``), then wait for
        its thread (a Ctrl-C ends the wait: the loop is ending, nothing needs another one)."""
        with interrupts_held():
            self._entered = None  # a stopped loop has left everything
            if not self._serving:
                return
            self._serving = False
            # Queued, not waited for: a loop that is stuck (blocked by a call that never
            # returns) would hold the wait, and Ctrl-C, for ever; the thread's end is waited
            # for below, a Ctrl-C ending that wait.
            with contextlib.suppress(RuntimeError):  # RuntimeError: the loop has ended
                _hand_to_loop(_Call(self.portal, self.portal.stop, (cancel,)))
            while self._thread.is_alive():
                raise_held()
                self._thread.join(POLL_S)


#: How often a wait for the loop looks whether a Ctrl-C was held back meanwhile (the most a
#: Ctrl-C waits before it is raised).
POLL_S = 0.05


def _wait(future: Future[T]) -> T:
    """``future``'s outcome, waited for with Ctrl-C held back; one that comes meanwhile is
    raised here (:func:`raise_held`; if SIGINT's handler does not raise, the wait goes on). A
    ``KeyboardInterrupt`` raised inside the wait itself could leave the future's lock held by
    this thread, and the loop blocked for ever as it sets the outcome."""
    with interrupts_held():
        while True:
            raise_held()
            try:
                return future.result(POLL_S)
            except concurrent.futures.TimeoutError:
                if future.done():  # the call's own TimeoutError, not the poll's
                    raise


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
        self._calls = portal.calls
        self._task: asyncio.Task[T] | None = None

    def start(self) -> None:
        """On the loop: start the task (unless :meth:`cancel` came first)."""
        if not self.result.set_running_or_notify_cancel():
            self.ended.set()
            return
        self._task = self._loop.create_task(self._fn(*self._args))
        self._calls.add(self._task)
        self._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[T]) -> None:
        self._calls.discard(task)
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
    # Held from the hand-off: an interrupt there would leave it unknown whether the loop has
    # the call (it is raised in the wait, which cancels the call).
    with interrupts_held():
        _hand_to_loop(call)
        return _outcome_or_cancel(call, call.result)


def _outcome_or_cancel(call: _Call[Any], future: Future[T]) -> T:
    """``future``'s outcome (set by ``call``'s task); when the wait is interrupted (or fails),
    ``call`` is cancelled and has ended before the interrupt goes on."""
    try:
        return _wait(future)
    except BaseException:
        with interrupts_held():
            call.cancel()
            call.ended.wait(CANCEL_WAIT_S)
        raise


class EnteredOnLoop:
    """An async context manager entered, and later exited, by one task of a bridge's loop (as
    anyio's ``BlockingPortal.wrap_async_context_manager``, whose waits :func:`_wait` replaces).

    :meth:`enter` waits until the task is inside the block, :meth:`exit` tells it to leave and
    waits until it has; either, interrupted, cancels the task and waits for it to end first.
    """

    def __init__(self, portal: BlockingPortal, manager: AbstractAsyncContextManager[Any]) -> None:
        assert isinstance(portal, LoopPortal), "a layer's portal is its bridge's"
        self._entered: Future[None] = Future()
        self._leave: asyncio.Event | None = None  # made on the loop, by the task
        self._call = _Call(portal, self._hold, (manager,))

    async def _hold(self, manager: AbstractAsyncContextManager[Any]) -> None:
        leave = self._leave = asyncio.Event()
        try:
            async with manager:
                self._entered.set_result(None)
                await leave.wait()
        except BaseException as exc:
            if not self._entered.done():  # entering failed: :meth:`enter` raises it
                self._entered.set_exception(exc)
            raise

    def enter(self) -> None:
        """Enter the block on the loop (its error, if entering fails, is raised here)."""
        with interrupts_held():
            _hand_to_loop(self._call)
            _outcome_or_cancel(self._call, self._entered)

    def exit(self) -> None:
        """Leave the block on the loop (its error, if leaving fails, is raised here)."""
        with interrupts_held():
            leave = self._leave
            assert leave is not None, "entered first"
            self._call._loop.call_soon_threadsafe(leave.set)
            _outcome_or_cancel(self._call, self._call.result)
