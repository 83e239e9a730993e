"""The iterator over one epoch or the endless stream (:class:`EpochIterator`); the state it
changes lives in the layer's :class:`~._session.Session`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

import anyio
import anyio.lowlevel

from ._batch import Batch
from ._errors import StateError
from ._pipeline import EpochEnd, Failure, Item, Mode, Run
from ._session import Session

__all__ = ["EpochIterator"]


class _Owner(Protocol):
    """What an iterator needs of its layer."""

    def _session_for(self, it: EpochIterator) -> Session:
        """The open session, or a :class:`~asynchdf5.StateError`."""
        ...

    def _iterate_sync(self, it: EpochIterator) -> Iterator[Batch]:
        """``it`` through the sync bridge."""
        ...


#: The longest a consumer that takes ready batches back to back (and never awaits in its own
#: step) keeps the event loop from other tasks: then taking a batch lets them run (those whose
#: timers came due meanwhile too), and honours cancellation. The two loop round trips cost
#: about 1 % of this.
PAUSE_EVERY_S = 0.001
#: The timer the iterator waits for when it lets the loop run (see ``_receive``): past at once.
PAUSE_TIMER_S = 1e-6


def _clock_runs(loop_elapsed: float, real_elapsed: float) -> bool:
    """Whether the event loop's clock moved about as real time did (0.5x to 2x): a virtual
    clock that stands still or only jumps (trio's ``MockClock``, as test suites use) would
    never fire the pause's timer, and the consumer would wait for it forever."""
    return 0.5 * real_elapsed <= loop_elapsed <= 2 * real_elapsed


class EpochIterator:
    """Iterates one epoch (``async for batch in layer``) or the endless stream
    (``layer.stream()``), yielding :class:`~asynchdf5.Batch` objects.

    Made by the layer; a layer serves one live iterator at a time. The iteration ends at the end
    of the epoch (``StopAsyncIteration``), with the error that stopped the pipeline (after every
    complete batch before it), or when closed with :meth:`aclose`; leaving an ``async for`` with
    ``break`` drops the iterator, which ends it too. The next iteration then starts the next
    epoch. Using an iterator after its layer was closed is a :class:`~asynchdf5.StateError`.

    Attributes
    ----------
    mode : {"epoch", "stream"}
        One epoch, or the endless stream of full batches across epochs.
    """

    def __init__(self, owner: _Owner, mode: Mode) -> None:
        self._owner = owner
        self.mode: Mode = mode
        #: Set by the sync bridge, which hands batches over in the ``for`` loop's thread.
        self.bridged = False
        self.done = False
        self._session: Session | None = None
        self._run: Run | None = None
        self._paused = time.perf_counter()  # when this iterator last let the event loop run
        self._paused_loop: float | None = None  # the event loop's clock then (None: unknown)

    def __repr__(self) -> str:
        state = "done" if self.done else "open"
        return f"<asynchdf5.EpochIterator mode={self.mode!r} {state}>"

    def __aiter__(self) -> EpochIterator:
        return self

    async def __anext__(self) -> Batch:
        session = self._session
        if session is not None and session.last_handed is not None:
            # The consumer's own step: from the last batch handed over to this ask.
            now = time.perf_counter()
            session.stats.consumer.step_seconds += now - session.last_handed
            session.last_handed = None
        run = self._run
        if run is not None and run.ready and not self.done:
            # The fast path: a batch of the group taken last time, handed over without a trip
            # through the event loop, unless the consumer has not let the loop run for
            # PAUSE_EVERY_S (then _receive does, and checks for cancellation).
            item = run.ready[0]
            if type(item) is Batch and time.perf_counter() - self._paused < PAUSE_EVERY_S:
                run.ready.popleft()
                assert self._session is not None
                return self._accept(self._session, item)
        if self.done:
            raise StopAsyncIteration
        try:
            return await self._next()
        except StopAsyncIteration:
            raise
        except BaseException:
            # Cancelled, or failed: like an async generator, the iteration is over.
            self._leave()
            raise

    async def _next(self) -> Batch:
        session = self._session
        if session is None:
            session = self._session = self._owner._session_for(self)
            if session.sync and not self.bridged:
                raise StateError(
                    "the layer was opened with `with`: iterate it with `for`, not `async for`"
                )
            self._run = await session.begin(self)
            self._mark_paused()  # the loop ran meanwhile; and the pause needs its clock's reading
        elif session.closed:
            raise StateError(
                "this iterator's layer was closed: open the layer again and start a new iteration"
            )
        run = self._run
        assert run is not None
        while True:
            item = await self._receive(session, run)
            if isinstance(item, Batch):
                return self._accept(session, item)
            if isinstance(item, EpochEnd):
                session.epoch_ended(self, item.epoch)
                if self.mode == "epoch":
                    self.done = True
                    raise StopAsyncIteration
                continue
            assert isinstance(item, Failure)
            self.fail()
            raise item.error

    async def _receive(self, session: Session, run: Run) -> Item:
        """The next item: from the group taken last, else the next group (waiting for it)."""
        ready = run.ready
        now = time.perf_counter()
        if now - self._paused >= PAUSE_EVERY_S:
            # A consumer whose step never awaits would otherwise keep the event loop from
            # other tasks for a whole group of batches: let them run (and honour cancellation).
            # Tasks whose timers came due during the step are not ready yet: on asyncio a timer
            # completes a future, which then queues its task, behind us. Waiting for a timer of
            # our own lets every timer due before it fire first, and the checkpoint after it
            # lets the tasks they woke run (on trio, whatever order a batch of tasks runs in).
            # Only where the loop's clock runs: no timer comes due on one that stands still.
            then = self._paused_loop
            if then is not None and _clock_runs(anyio.current_time() - then, now - self._paused):
                await anyio.sleep(PAUSE_TIMER_S)
            await anyio.lowlevel.checkpoint()
            self._mark_paused()
        if ready:
            return ready.popleft()
        try:
            # Cancellation is honoured here, once per group, at the cost of no loop round trip.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                group = run.take_nowait()
            except anyio.WouldBlock:
                t0 = time.perf_counter()
                try:
                    group = await run.take()
                finally:
                    t1 = self._mark_paused()
                    session.stats.consumer.wait_seconds += t1 - t0
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StateError(
                "this iterator's layer was closed while it waited for a batch"
            ) from None
        ready.extend(group)
        return ready.popleft()

    def _mark_paused(self) -> float:
        """The event loop has just run other tasks: note when, on both clocks."""
        self._paused_loop = anyio.current_time()
        self._paused = now = time.perf_counter()
        return now

    def _accept(self, session: Session, batch: Batch) -> Batch:
        if not self.bridged:
            try:
                session.delivery.hand_off(batch)
            except BaseException:
                self.fail()
                raise
            session.yielded(self, batch)
        session.handed(self, batch)
        if not self.bridged:
            session.last_handed = time.perf_counter()
        return batch

    def yielded(self, batch: Batch) -> None:
        """The sync bridge handed ``batch`` to its ``for`` loop (in that loop's thread)."""
        if self._session is not None:
            self._session.yielded(self, batch)

    def stepped(self, seconds: float) -> None:
        """The sync bridge's ``for`` loop spent ``seconds`` on a batch before asking again."""
        if self._session is not None:
            self._session.stats.consumer.step_seconds += seconds

    def fail(self) -> None:
        """The pipeline failed, or a batch could not be handed over: this iteration ends, the
        run is stopped, and the next iteration starts the next epoch whole."""
        self.done = True
        if self._session is not None and self._session.consumer() in (self, None):
            self._session.failed(self)

    async def aclose(self) -> None:
        """End this iteration before its end (what leaving ``async for`` with ``break`` does)."""
        self._leave()

    def close(self) -> None:
        """:meth:`aclose` for sync code."""
        self._leave()

    def _leave(self) -> None:
        if not self.done:
            self.done = True
            if self._session is not None:
                self._session.left(self)

    async def next_batches(self, limit: int) -> list[Batch]:
        """The next batch and up to ``limit - 1`` more that are ready now; ``[]`` at the end.

        For the sync bridge: one trip across its thread bridge per group of ready batches, never
        more than are already gathered (an epoch is never collected).
        """
        try:
            out = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        session, run = self._session, self._run
        assert session is not None and run is not None
        ready = run.ready
        while len(out) < limit and not self.done and session.run is run:
            if not ready:
                try:
                    ready.extend(run.take_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            item = ready[0]
            if not isinstance(item, Batch):
                break  # an epoch end or a failure: the next call handles it
            ready.popleft()
            out.append(self._accept(session, item))
        return out

    def __iter__(self) -> Iterator[Batch]:
        """Iterate with ``for`` (the layer must be open with ``with``)."""
        session = self._owner._session_for(self)
        if not session.sync:
            raise StateError(
                "the layer was opened with `async with`: iterate it with `async for`, not `for`"
            )
        return self._owner._iterate_sync(self)
