"""Epochs: the state of an open layer (:class:`Session`) and the iterator over one epoch or the
endless stream (:class:`EpochIterator`).

The session owns everything an open layer has (the reader, the cache slots, the delivery, the
background :class:`~._pipeline.Run`) and all epoch bookkeeping: how many epochs are finished,
which iterator is the consumer, the latest epoch it received a batch of. Iterators change that
state only through the session's methods.

One consumer at a time: a layer has at most one *live* iterator, one that is neither finished,
failed, closed, nor dropped (an ``async for`` left with ``break`` drops its iterator at once). A
second one is a :class:`~asynchdf5.StateError`, never a silently truncated epoch.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from ._batch import Batch
from ._cache import Slot
from ._delivery import Delivery
from ._errors import StateError
from ._pipeline import EpochEnd, Failure, Item, Mode, Run
from ._plan import EpochPlan
from ._read import Reader
from ._stats import Stats

__all__ = ["EpochIterator", "Session"]


class Session:
    """The state of an open layer, from ``async with`` (or ``with``) to its end."""

    def __init__(
        self,
        *,
        reader: Reader,
        slots: list[Slot] | None,
        delivery: Delivery,
        stats: Stats,
        plan: Callable[[int, bool], EpochPlan],
        batch_size: int,
        prefetch: int,
        epoch: int,
        task_group: TaskGroup,
        opened_at: float,
        sync: bool,
    ) -> None:
        self.reader = reader
        self.slots = slots
        self.delivery = delivery
        self.stats = stats
        self.plan = plan
        self.batch_size = batch_size
        self.prefetch = prefetch
        #: Epochs finished (an epoch left early counts once the next iteration starts).
        self.epoch = epoch
        self.task_group = task_group
        self.opened_at = opened_at
        #: Opened with ``with``: iterated through the sync bridge only.
        self.sync = sync
        self.closed = False
        self.run: Run | None = None
        self._consumer: weakref.ReferenceType[EpochIterator] | None = None
        self._touched: int | None = None  # latest epoch the consumer got a batch of
        # Where the consumer is: batches yielded to it (not prefetched), in its epoch; for a
        # stream, the samples yielded since it began at epoch `_start`.
        #: When the consumer last got a batch (its step time runs from there to its next ask).
        self.last_handed: float | None = None
        self._mode: Mode = "epoch"
        self._start = epoch
        self._batches = 0
        self._samples = 0

    # --- the run ------------------------------------------------------------------------------

    def start_run(self, mode: Mode) -> Run:
        run = Run(
            self.reader,
            self.slots,
            lambda epoch: self.plan(epoch, mode == "stream"),
            mode=mode,
            start_epoch=self.epoch,
            batch_size=self.batch_size,
            delivery=self.delivery,
            prefetch=self.prefetch,
            stats=self.stats,
        )
        self.run = run
        self.task_group.start_soon(run.main)
        return run

    # --- what iterators report ----------------------------------------------------------------

    def consumer(self) -> EpochIterator | None:
        """The live iterator, if any."""
        it = self._consumer() if self._consumer is not None else None
        return None if it is None or it.done else it

    async def begin(self, it: EpochIterator) -> Run:
        """``it`` becomes the consumer: the run serving its mode from the next epoch."""
        if self.closed:
            raise StateError("the layer is closed: open it with `async with layer:` first")
        live = self.consumer()
        if live is not None and live is not it:
            raise StateError(
                f"another iterator of this layer is still open ({live!r}): a layer serves one "
                "consumer at a time. Finish that iteration, or close it (`await it.aclose()`, "
                "`it.close()` in sync code), before starting another"
            )
        self._settle()
        self._consumer = weakref.ref(it)
        self._mode, self._start, self._batches, self._samples = it.mode, self.epoch, 0, 0
        run = self.run
        if run is None or run.mode != it.mode or run.head_epoch != self.epoch:
            if run is not None:
                await run.stop()
            run = self.start_run(it.mode)
        return run

    def _settle(self) -> None:
        """The previous consumer left early: the epoch it was in is over."""
        if self._touched is not None:
            self.epoch = max(self.epoch, self._touched + 1)
        self._touched = None
        self._consumer = None

    def handed(self, it: EpochIterator, batch: Batch) -> None:
        """``batch`` was handed to ``it``."""
        consumer = self.stats.consumer
        if consumer.first_batch_seconds is None:
            consumer.first_batch_seconds = time.perf_counter() - self.opened_at
        consumer.batches += 1
        consumer.samples += len(batch.indices)
        self._touched = batch.epoch
        if self.run is not None:
            self.run.head_epoch = None

    def yielded(self, it: EpochIterator, batch: Batch) -> None:
        """``batch`` reached the consumer (in the consumer's thread)."""
        if it.mode == "epoch" and batch.epoch != self._start:
            self._start, self._batches, self._samples = batch.epoch, 0, 0
        self._batches += 1
        self._samples += len(batch.indices)

    def position(self) -> tuple[Mode, int, int, int]:
        """``(mode, epoch, batches, samples)``: where the consumer is. An epoch: its batches and
        samples yielded so far; a stream: the samples of ``epoch`` yielded (batches 0). With no
        live consumer: the next epoch, from its start."""
        if self.consumer() is None:
            touched = self._touched
            epoch = self.epoch if touched is None else max(self.epoch, touched + 1)
            return "epoch", epoch, 0, 0
        if self._mode == "epoch":
            return "epoch", self._start, self._batches, self._samples
        first = self.plan(self._start, True).n_samples  # left of the stream's first epoch
        if self._samples < first:
            return "stream", self._start, 0, self._samples
        share = self.plan(self._start + 1, True).n_samples
        rest = self._samples - first
        return "stream", self._start + 1 + rest // share, 0, rest % share

    def restart_at(self, epoch: int) -> None:
        """Serve ``epoch`` next, from a fresh plan (a state was loaded between epochs)."""
        self.epoch = epoch
        self._touched = None
        self._start, self._batches, self._samples = epoch, 0, 0
        if self.run is not None:
            self.run.head_epoch = None  # the next iteration replaces the run

    def epoch_ended(self, it: EpochIterator, epoch: int) -> None:
        """Every batch of ``epoch`` has been handed over."""
        self.epoch = epoch + 1
        self._touched = None
        if it.mode == "epoch":
            self._start, self._batches, self._samples = epoch + 1, 0, 0
        if self.run is not None:
            self.run.head_epoch = epoch + 1
        if it.mode == "epoch":
            self._consumer = None

    def failed(self, it: EpochIterator) -> None:
        """``it``'s iteration ended with an error: the epoch is over, the run stopped."""
        if self._touched is not None:
            self.epoch = max(self.epoch, self._touched + 1)
        elif it.mode == "epoch":
            self.epoch += 1
        self._touched = None
        self._consumer = None
        if self.run is not None:
            self.run.scope.cancel()  # a no-op when the run itself failed: it is over
            self.run.items.close()
            self.run.ready.clear()
        self.run = None

    def left(self, it: EpochIterator) -> None:
        """``it`` was closed (or cancelled) before its end: the epoch it was in counts as
        finished once the next iteration starts, as for an iterator dropped by ``break``."""
        if self._consumer is not None and self._consumer() is it:
            self._consumer = None

    # --- closing ------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the run (closing: the task group then waits for it)."""
        self.closed = True
        if self.run is not None:
            self.run.scope.cancel()

    async def aclose(self) -> None:
        """Release the reader's files and threads and the delivery (after the run ended). A
        consumer still iterating has left its epoch early: that epoch is over."""
        self.closed = True
        if self.run is not None:
            self.run.items.close()
            self.run.ready.clear()
        self.run = None
        self._settle()
        try:
            await self.reader.aclose()
        finally:
            self.delivery.close()


class _Owner(Protocol):
    """What an iterator needs of its layer."""

    def _session_for(self, it: EpochIterator) -> Session:
        """The open session, or a :class:`~asynchdf5.StateError`."""
        ...

    def _iterate_sync(self, it: EpochIterator) -> Iterator[Batch]:
        """``it`` through the sync bridge."""
        ...


#: The longest a consumer that takes ready batches back to back (and never awaits in its own
#: step) keeps the event loop from other tasks: then taking a batch lets them run once, and
#: honours cancellation. A loop round trip costs a few microseconds: well under 1 % of this.
PAUSE_EVERY_S = 0.001


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
            await anyio.lowlevel.checkpoint()
            self._paused = time.perf_counter()
        if ready:
            return ready.popleft()
        try:
            # Cancellation is honoured here, once per group, at the cost of no loop round trip.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                group = run.items.receive_nowait()
            except anyio.WouldBlock:
                t0 = time.perf_counter()
                try:
                    group = await run.items.receive()
                finally:
                    self._paused = t1 = time.perf_counter()
                    session.stats.consumer.wait_seconds += t1 - t0
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StateError(
                "this iterator's layer was closed while it waited for a batch"
            ) from None
        ready.extend(group)
        return ready.popleft()

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

        For the sync bridge: one trip across its thread bridge per handful of batches, never
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
                    ready.extend(run.items.receive_nowait())
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
