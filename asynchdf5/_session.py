"""The state of an open layer (:class:`Session`), from ``async with`` (or ``with``) to its end.

The session owns everything an open layer has (the reader, the cache slots, the delivery, the
background :class:`~._pipeline.Run`) and all epoch bookkeeping: how many epochs are finished,
which iterator is the consumer, the latest epoch it received a batch of. Iterators
(:mod:`._iterator`) change that state only through the session's methods.

One consumer at a time: a layer has at most one *live* iterator, one that is neither finished,
failed, closed, nor dropped (an ``async for`` left with ``break`` drops its iterator at once). A
second one is a :class:`~asynchdf5.StateError`, never a silently truncated epoch.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from ._batch import Batch
from ._cache import Slot, free_slots
from ._delivery import Delivery
from ._errors import StateError
from ._pipeline import Mode, Run
from ._plan import EpochPlan
from ._process import ProcessReader
from ._read import Reader
from ._stats import Stats

if TYPE_CHECKING:
    from ._iterator import EpochIterator

__all__ = ["Session"]


class Session:
    """The state of an open layer, from ``async with`` (or ``with``) to its end."""

    def __init__(
        self,
        *,
        reader: Reader | ProcessReader,
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
        #: A failed run, stopping: its threads may still read into the cache slots, so the
        #: next run starts only once it is done.
        self._ending: Run | None = None
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
        run: Run
        if isinstance(self.reader, ProcessReader):  # process=True: the helper runs the pipeline
            run = self.reader.new_run(mode, self.epoch)
            self.run = run
            self.task_group.start_soon(run.main)
            return run
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
            if self._ending is not None:
                await self._ending.done.wait()
                self._ending = None
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
            self.run.shut()
            self._ending = self.run
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
            self.run.shut()
        self.run = None
        self._settle()
        try:
            await self.reader.aclose()
        finally:
            self.delivery.close()
            slots, self.slots = self.slots, None
            if slots:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(free_slots, slots)
