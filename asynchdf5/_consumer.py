"""Where the consumer is (:class:`Consumer`): the one owner of a layer's consumer-side state.

The consumer is the code that iterates a layer. Its state is one small state machine, changed
only here:

- the layer is ``closed``, ``opening``, ``open`` or ``closing``; open, it has a reader, cache
  slots and a background :class:`~._pipeline.Run` in its task group;
- ``epoch``, the epochs finished, and the live iterator (at most one) with the epoch it is in;
- the position: the batches and samples of that epoch handed over (what ``state_dict()``
  saves; kept in its :class:`~._place.Place`, counted by :meth:`~._place.Place.count` only),
  and the consumer's stats (:class:`~._stats.ConsumerStats`, the samples of each stream
  included), both written here only.

Iterators (:class:`~._iterator.EpochIterator`) are views: each holds its own mode and whether
it is done, and asks the consumer for every batch; in a ``for`` loop the iterator drives
itself across the opening's portal (:mod:`._sync`) and hands each batch over in the loop's
thread (:meth:`Consumer.deliver`). The consumer calls nothing above it, iterators included: it
holds the portal as data, never a callback. Plans come from the layer's :class:`~._planner.Planner`.

One consumer at a time: a second *live* iterator (neither finished, failed, closed, nor dropped:
an ``async for`` left with ``break`` drops its iterator at once) is a
:class:`~asynchdf5.StateError`, never a silently truncated epoch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
import numpy as np
from anyio.from_thread import BlockingPortal

from ._batch import Batch
from ._delivery import Delivery
from ._errors import StateError
from ._mix import StreamRows
from ._opened import Opened
from ._pace import PAUSE_EVERY_S, Pace
from ._pipeline import EpochEnd, Failure, Item, Mode, Run
from ._place import Place, Position
from ._planner import Planner
from ._process import ProcessReader
from ._schemas import Schemas, check_stream
from ._stats import Stats

if TYPE_CHECKING:
    from ._iterator import EpochIterator

__all__ = ["Consumer", "Position"]


class Consumer:
    """Where a layer's consumer is, from construction on, across openings (see the module)."""

    def __init__(
        self,
        *,
        planner: Planner,
        delivery: Delivery,
        stats: Stats,
        batch_size: int,
        prefetch: int,
    ) -> None:
        self.planner = planner
        self.delivery = delivery
        self.stats = stats
        self._counts = stats.consumer  # the consumer's stats: written here only
        # Several streams: says each batch's rows' stream as it is handed over (set at open).
        self._labels: _StreamLabels | None = None
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.state: Literal["closed", "opening", "open", "closing"] = "closed"
        #: Where the consumer is: epochs finished, the live iterator, its position.
        self.place = Place()
        #: Openings so far: an iterator serves the opening it started in only.
        self.openings = 0
        #: What the open layer has (None: not open).
        self.opened: Opened | None = None
        self.run: Run | None = None
        #: A failed run, stopping: its threads may still read into the cache slots, so the
        #: next run starts only once it is done.
        self._ending: Run | None = None
        #: The items of the group taken last, not yet served.
        self.ready: collections.deque[Item] = collections.deque()
        # The epoch at the head of the run's queue while the consumer stands at an epoch
        # boundary (else None): the next iteration may go on with that run.
        self._boundary: int | None = None
        #: When the consumer last got a batch (its step time runs from there to its next ask).
        self.last_handed: float | None = None
        self._pace = Pace()  # when the consumer last let the event loop run

    @property
    def epoch(self) -> int:
        """Epochs finished (an epoch left early counts once the next iteration starts)."""
        return self.place.epoch

    # --- opening and closing ------------------------------------------------------------------

    def opening(self) -> int:
        """The layer starts opening (:class:`StateError` unless it is closed); the epoch the
        opening serves first (asked here, so the opening reaches the consumer only to start
        and to be adopted: :meth:`open`)."""
        if self.state != "closed":
            raise StateError(f"the layer is already {self.state}: open it once at a time")
        self.state = "opening"  # before any await: a second opener sees it at once
        return self.place.epoch

    def not_opened(self) -> None:
        """Opening failed: the layer is closed."""
        self.state = "closed"

    async def open(self, opened: Opened) -> None:
        """The layer is open with ``opened`` (built whole by the opening): the first epoch's
        run starts (its first chunk is read now)."""
        self.opened = opened
        self.openings += 1
        self.state = "open"
        streams = opened.shape.streams
        self._labels = _StreamLabels(streams) if streams else None
        try:
            self.start_run("epoch")
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.close(type(exc), exc, exc.__traceback__)
            raise

    async def close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the run and release everything (in the task that opened the layer). Never
        swallows what left the body (``exc``): a cancellation from outside goes on. A consumer
        still iterating has left its epoch early: that epoch is over."""
        opened = self.opened
        if self.state != "open" or opened is None:
            return None
        opened.check_closer()
        self.state = "closing"
        try:
            if self.run is not None:
                self.run.scope.cancel()
            await opened.exit(exc_type, exc, tb)
        finally:
            try:
                self._drop_run()
                self.place.settle()
                await opened.release(self.delivery)
            finally:
                self.opened = None
                self.state = "closed"

    # --- the run ------------------------------------------------------------------------------

    def start_run(self, mode: Mode) -> Run:
        """Start the run serving ``mode`` from the next epoch, in the open layer's task group
        (``process=True``: a run the helper process serves)."""
        opened = self.opened
        assert opened is not None
        run: Run
        reader = opened.reader
        if isinstance(reader, ProcessReader):
            run = reader.new_run(mode, self.epoch, self.run_state())
        else:
            run = Run(
                reader,
                opened.slots,
                self.planner,
                mode=mode,
                start_epoch=self.epoch,
                batch_size=self.batch_size,
                delivery=self.delivery,
                prefetch=self.prefetch,
                stats=self.stats,
                schemas=Schemas.of(opened.shape.streams),
            )
        opened.task_group.start_soon(run.main)
        self.run = run
        self.ready.clear()
        self._boundary = self.epoch
        return run

    def _drop_run(self) -> None:
        """The consumer is done with the run: drop what is queued for it."""
        if self.run is not None:
            self.run.shut()
        self.run = None
        self.ready.clear()

    # --- iterators ----------------------------------------------------------------------------

    def live(self) -> EpochIterator | None:
        """The live iterator, if any."""
        return self.place.live()

    def portal(self) -> BlockingPortal:
        """The portal a ``for`` loop takes its batches through (the layer opened with
        ``with``); :class:`StateError` when the layer is not open so."""
        opened = self._check_open()
        if opened.portal is None:
            raise StateError(
                "the layer was opened with `async with`: iterate it with `async for`, not `for`"
            )
        return opened.portal

    def _check_open(self) -> Opened:
        if self.state != "open" or self.opened is None:
            raise StateError(
                "the layer is not open: iterate inside `async with layer:` (or `with layer:`)"
            )
        return self.opened

    async def begin(self, it: EpochIterator) -> int:
        """``it`` becomes the consumer: the run serving its mode from the next epoch. Returns
        the opening ``it`` serves from now on (the iterator keeps it)."""
        if self._check_open().portal is not None and not it.bridged:
            raise StateError(
                "the layer was opened with `with`: iterate it with `for`, not `async for`"
            )
        if it.mode == "stream":
            check_stream(self.planner.shape)
        live = self.live()
        if live is not None and live is not it:
            raise StateError(
                f"another iterator of this layer is still open ({live!r}): a layer serves one "
                "consumer at a time. Finish that iteration, or close it (`await it.aclose()`, "
                "`it.close()` in sync code), before starting another"
            )
        self.place.begin(it)
        run = self.run
        if run is None or run.mode != it.mode or self._boundary != self.epoch:
            if run is not None:
                await run.stop()
            if self._ending is not None:
                await self._ending.done.wait()
                self._ending = None
            self.start_run(it.mode)
        self._pace.mark()  # the loop ran meanwhile; and the pause needs its clock's reading
        return self.openings

    def next_ready(self, it: EpochIterator) -> Batch | None:
        """A batch of the group taken last, handed to ``it`` without a trip through the event
        loop; None when none is ready, or when ``it`` has not let the loop run for
        :data:`PAUSE_EVERY_S` (then :meth:`next` does, and checks for cancellation). Counts the
        consumer's step: from the last batch handed over to this ask."""
        last = self.last_handed
        if last is not None:
            self.last_handed = None
            self._counts.step_seconds += time.perf_counter() - last
        ready = self.ready
        if ready and it.opening == self.openings and not it.done:
            item = ready[0]
            if type(item) is Batch and time.perf_counter() - self._pace.paused < PAUSE_EVERY_S:
                ready.popleft()
                return self._accept(it, item)
        return None

    async def next(self, it: EpochIterator) -> Batch:
        """The next batch for ``it`` (begun: :meth:`begin`), waiting for it;
        ``StopAsyncIteration`` at the end of an epoch; the pipeline's error when it failed."""
        if it.opening != self.openings or self.state != "open":
            raise StateError(
                "this iterator's layer was closed: open the layer again and start a new iteration"
            )
        run = self.run
        assert run is not None
        while True:
            item = await self._receive(run)
            if isinstance(item, Batch):
                return self._accept(it, item)
            if isinstance(item, EpochEnd):
                self._epoch_ended(it, item.epoch)
                if it.mode == "epoch":
                    raise StopAsyncIteration
                continue
            assert isinstance(item, Failure)
            self.fail(it)
            raise item.error

    async def _receive(self, run: Run) -> Item:
        """The next item: from the group taken last, else the next group (waiting for it)."""
        ready, pace = self.ready, self._pace
        now = time.perf_counter()
        if now - pace.paused >= PAUSE_EVERY_S:  # checked here: no coroutine made otherwise
            await pace.pause(now)
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
                    t1 = self._pace.mark()
                    self._counts.wait_seconds += t1 - t0
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StateError(
                "this iterator's layer was closed while it waited for a batch"
            ) from None
        ready.extend(group)
        return ready.popleft()

    def ready_now(self, it: EpochIterator, limit: int) -> list[Batch]:
        """Up to ``limit`` more batches for ``it`` that are gathered already (after one it got
        from :meth:`next`), stopping at an epoch's end or a failure, which the next
        :meth:`next` handles; never waits. For a ``for`` loop: one trip across the bridge per
        group of ready batches."""
        out: list[Batch] = []
        run, ready = self.run, self.ready
        while len(out) < limit and not it.done and run is not None and self.run is run:
            if not ready:
                try:
                    ready.extend(run.take_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            item = ready[0]
            if not isinstance(item, Batch):
                break  # an epoch end or a failure: the next call handles it
            ready.popleft()
            out.append(self._accept(it, item))
        return out

    # --- batches handed over: the position and the consumer's stats ---------------------------

    def _accept(self, it: EpochIterator, batch: Batch) -> Batch:
        """``batch`` is handed to ``it`` (bridged: to its ``for`` loop, which hands it over in the
        ``for`` loop's thread with :meth:`deliver`)."""
        rows = len(batch.indices)
        bridged = it.bridged
        place = self.place
        if not bridged:
            try:
                self.delivery.hand_off(batch)
            except BaseException:
                self.fail(it)
                raise
            place.count(it.mode, batch.epoch, rows)
        counts = self._counts
        if counts.first_batch_seconds is None:
            assert self.opened is not None
            counts.first_batch_seconds = time.perf_counter() - self.opened.at
        counts.batches += 1
        counts.samples += rows
        labels = self._labels
        if labels is not None:
            per_stream = counts.stream_samples
            for name, n in labels(batch):
                per_stream[name] = per_stream.get(name, 0) + n
        place.touch(batch.epoch)
        self._boundary = None
        if not bridged:
            self.last_handed = time.perf_counter()
        return batch

    def deliver(self, it: EpochIterator, batch: Batch, stepped: float = 0.0) -> None:
        """``it``'s ``for`` loop takes ``batch`` (in that loop's thread): it is
        made ready there (a device's: on the current CUDA stream), and counts for
        ``state_dict()`` from now on. ``stepped``: the seconds the loop spent on the batch
        before (:meth:`stepped`), counted in the same call, one per step."""
        self._counts.step_seconds += stepped
        self.delivery.hand_off(batch)
        self.place.count(it.mode, batch.epoch, len(batch.indices))

    def stepped(self, seconds: float) -> None:
        """A ``for`` loop spent ``seconds`` on a batch before asking again (the last of its
        iteration: the others' come with the next :meth:`deliver`)."""
        self._counts.step_seconds += seconds

    def _epoch_ended(self, it: EpochIterator, epoch: int) -> None:
        """Every batch of ``epoch`` has been handed over."""
        self.place.ended(it.mode, epoch)
        self._boundary = epoch + 1

    def fail(self, it: EpochIterator) -> None:
        """The pipeline failed, or a batch could not be handed over: ``it``'s iteration ends,
        the epoch is over, the run is stopped, and the next iteration starts the next epoch
        whole (the iterator marks itself done as the error reaches it)."""
        if it.opening != self.openings or self.live() not in (it, None):
            return
        self.place.failed(it.mode)
        if self.run is not None:
            self.run.scope.cancel()  # a no-op when the run itself failed: it is over
            self._ending = self.run
        self._drop_run()

    def leave(self, it: EpochIterator) -> None:
        """``it`` is closed (or cancelled, or failed) before its end: the epoch it was in counts
        as finished once the next iteration starts, as for an iterator dropped by ``break``."""
        self.place.drop(it)

    # --- where the consumer is ----------------------------------------------------------------

    def position(self) -> Position:
        """Where the consumer is: :meth:`~._place.Place.position`."""
        return self.place.position(self.planner.plan)

    def run_state(self) -> dict[str, Any]:
        """Where a run that starts now starts, as a state (for the helper process of
        ``process=True``, which loads it and iterates from there). A run starts with nothing
        of its epoch handed over yet; in the epoch of a state loaded, that is the state itself,
        whatever mode the run serves (``state_dict()`` would say the mode's start: the
        position of a run in another mode than the state's does not carry the state's)."""
        planner, (mode, epoch, _, _) = self.planner, self.position()
        r = planner.resume
        if r is not None and epoch == r.epoch:
            return planner.state((r.mode, epoch, 0, 0))
        return planner.state((mode, epoch, 0, 0))

    def restart_at(self, epoch: int) -> None:
        """Serve ``epoch`` next, from a fresh plan (``set_epoch``, or a state loaded; the layer
        allows it only while no iterator is live)."""
        self.place.restart_at(epoch)
        self._boundary = None  # the next iteration replaces the run


class _StreamLabels:
    """Says which stream each row of a batch came from (``batch.streams``: indices into the
    layer's ``stream_names``); the consumer counts what it says."""

    def __init__(self, streams: Sequence[StreamRows]) -> None:
        self.names = tuple(s.name for s in streams)
        self.starts = np.array([s.start for s in streams[1:]], np.int64)

    def __call__(self, batch: Batch) -> list[tuple[str, int]]:
        """Label ``batch``'s rows; the samples of each stream it holds (streams with none left
        out)."""
        labels = np.searchsorted(self.starts, batch.indices, side="right")
        batch.streams = labels
        counts = np.bincount(labels, minlength=len(self.names)).tolist()
        return [(self.names[s], n) for s, n in enumerate(counts) if n]
