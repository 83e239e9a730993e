"""The gathering stage: threads that gather the batcher's groups, handed to the consumer in order.

The batcher (a task in the event loop) cuts each chunk's serving order into groups of batches and
queues them here with :meth:`Gatherers.put`; epoch ends and errors travel in the same queue, in
order. Worker threads take them one at a time, have the :class:`~._delivery.Delivery` gather,
transform (and upload) each group, and put the results where the consumer takes them without a
loop round trip (:class:`~._handoff.Handoff`), in the order the batcher queued them, whatever
order they finished in. None of them ever waits for the event loop. Where transformers run
(:attr:`Delivery.per_batch`), each batch is handed over as soon as it is transformed, ahead of
the rest of its group: one slow transformer call holds back only the batches after it. A
consumer that waits is woken by such a batch only when batches come slower than one per
:data:`POLL_S`; faster, it looks again every :data:`POLL_S` by itself (``Run.take``) and takes
every batch ready then. Each way costs it at most about one wake-up per batch: a wake-up per
batch of fast batches would cost the consumer more than taking them (tiny batches, light
transformers), and polling for slow ones would wake it several times per batch (a transformer
of a few milliseconds).

How many workers. Two by default, when the delivery allows it (:attr:`Delivery.concurrent`:
host batches without transformers): each gathers whole groups, the next free one takes the
next group. Otherwise one worker, which hands half of each large group to a helper thread and
waits for it (a transformer is never called from two threads at once, and a device's uploads
stay in one thread). Whole groups on two workers, rather than halves of every group, because
the halves are joined: on a machine whose cores are also busy with the reads, the helper's half
waits for a core while the worker that joined it sits idle, and the two halves run one after the
other.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ._batch import Batch
from ._delivery import Delivery
from ._errors import DataLayerError
from ._gather import verify
from ._handoff import Handoff
from ._priority import background
from ._specs import GroupSpec
from ._stats import GatherStats, StageClock

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["POLL_S", "Entry", "EpochEnd", "Failure", "Gatherers", "GroupItem", "Item", "leaf"]

#: With transformers, batches that are handed over one by one and come faster than one per this
#: many seconds are not each woken for: a consumer that waits for them looks again this often
#: (a batch waits at most about this long), since a wake-up costs several times what taking a
#: small batch does. Slower ones wake it (polling would wake it more often than they come).
POLL_S = 0.001


@dataclass(frozen=True)
class EpochEnd:
    """Marker: every batch of ``epoch`` has been sent."""

    epoch: int


@dataclass(frozen=True)
class Failure:
    """The run failed with ``error``; nothing follows."""

    error: BaseException


Item = Batch | EpochEnd | Failure
#: What the batcher queues for the workers; errors travel in order.
GroupItem = GroupSpec | EpochEnd | Failure
#: What the consumer gets per queued item: the group (its chunks are let go of when the consumer
#: takes it), its items, and whether it held a unit of the batcher's room.
Entry = tuple[GroupSpec | None, list[Item], bool]
#: A queued item: its place in the order, the item, whether it holds a unit of room.
_Work = tuple[int, GroupItem, bool]


class Gatherers:
    """The gathering stage of one run: :meth:`start`, :meth:`put` items (event-loop thread),
    :meth:`finish`, :meth:`join`. The consumer takes what they made from :attr:`out`."""

    def __init__(self, delivery: Delivery, stats: GatherStats, threads: int = 2) -> None:
        self.delivery = delivery
        self.stats = stats
        concurrent = threads > 1 and delivery.concurrent
        self.workers = threads if concurrent else 1
        # Batch by batch only with one worker: it makes the groups in order, so everything
        # queued before a group has been handed over when the group's first batch is.
        self._per_batch = self.workers == 1 and delivery.per_batch
        #: While a group is made batch by batch and its batches come faster than one per
        #: POLL_S: POLL_S, the consumer looks again that often and its batches are put without
        #: waking it (the group's own entry still does); otherwise None, each wakes it.
        self.poll: float | None = None
        self._fast = False  # the last batch made one by one came within POLL_S of the one before
        self._last = 0.0  # when it was handed over (or its group begun): perf_counter seconds
        self._helper = (
            ThreadPoolExecutor(1, "asynchdf5-gather-helper", initializer=background)
            if threads > 1 and not concurrent
            else None
        )
        #: Gathered items for the consumer, in the order they were put.
        self.out: Handoff[Entry] = Handoff()
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._queued = 0  # items put so far (event-loop thread only)
        self._lock = threading.Lock()  # guards what follows, and the stats
        self._finished: dict[int, Entry | None] = {}  # made, waiting for the ones before
        self._next = 0  # the next item to hand to the consumer
        self._failed = False  # a failure went to the consumer: nothing follows it
        self._stopping = False  # drop what is queued: nobody takes it
        # Idle with groups the consumer has not taken, the stage is blocked (the consumer is
        # behind); with none, starved (by the reader or the batcher).
        self._clock = StageClock(stats.stage, blocked=False)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.workers):
            name = "asynchdf5-gather" if i == 0 else f"asynchdf5-gather_{i}"  # as pools name theirs
            thread = threading.Thread(target=self._worker, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def put(self, item: GroupItem, permit: bool) -> None:
        """Queue ``item`` (event-loop thread); ``permit``: it holds a unit of the batcher's
        room, given back when the consumer takes it."""
        self._work.put((self._queued, item, permit))
        self._queued += 1

    def finish(self, drop: bool) -> None:
        """No more items: the workers end once the queue is done (``drop``: without making
        what is still queued)."""
        self._stopping = drop
        for _ in self._threads:
            self._work.put(None)

    def join(self) -> None:
        """Wait for the workers and the helper to end (blocking: at most a group each)."""
        for thread in self._threads:
            thread.join()
        if self._helper is not None:
            self._helper.shutdown()

    def _worker(self) -> None:
        if not self.delivery.runs_user_code:
            background()
        mine = GatherStats()  # this thread's seconds, added to the stage's under the lock
        work, clock = self._work, self._clock
        while True:
            got = work.get()
            if got is None:
                return
            seq, item, permit = got
            entry: Entry | None = None
            if not (self._stopping or self._failed):
                clock.start()
                if self._per_batch and isinstance(item, GroupSpec):
                    self._last = time.perf_counter()
                    self.poll = POLL_S if self._fast else None
                entry = self._make(item, permit, mine, seq)
                with self._lock:
                    self.stats.gather_seconds += mine.gather_seconds
                    self.stats.transform_seconds += mine.transform_seconds
                mine.gather_seconds = mine.transform_seconds = 0.0
            self._hand_on(seq, entry)
            self.poll = None
            if entry is not None:
                clock.stop(blocked=bool(self.out))

    def _make(self, item: GroupItem, permit: bool, stats: GatherStats, seq: int) -> Entry:
        if not isinstance(item, GroupSpec):  # an epoch end, or the error that ended a stage
            return (None, [item], permit)
        emitted = 0  # batches already handed over, one by one

        def emit(batch: Batch) -> None:
            nonlocal emitted
            verify(item.pieces)  # before the rows go anywhere (see below)
            items: list[Item] = [batch]
            if emitted in item.ends:
                items.append(EpochEnd(item.ends[emitted]))
            now = time.perf_counter()
            self._fast = now - self._last < POLL_S
            self._last = now
            with self._lock:
                assert self._next == seq, "batch by batch needs groups made in order"
                if not self._failed:
                    # A slow batch wakes a consumer that polls (it may have just looked).
                    self.out.put((None, items, False), urgent=not self._fast)
            self.poll = POLL_S if self._fast else None
            emitted += 1

        try:
            batches, error = self.delivery.make(
                item, stats, self._helper, emit if self._per_batch else None
            )
            verify(item.pieces)  # a mapped file changed: none of the rows is sure
        except Exception as exc:  # that, or a bug: reported in order
            batches, error = [], exc
        group: list[Item] = []
        # The batches not handed over one by one (fewer than item.sizes on an error).
        for i, batch in enumerate(batches, start=emitted):
            group.append(batch)
            if i in item.ends:
                group.append(EpochEnd(item.ends[i]))
        if error is not None:
            group.append(Failure(leaf(error)))
        # The group itself goes last, even with nothing left in it: taking it lets go of its
        # chunks and gives its room back to the batcher.
        return (item, group, permit)

    def _hand_on(self, seq: int, entry: Entry | None) -> None:
        """Item ``seq`` is done (``None``: dropped); hand the consumer every item done in order
        so far. After a failure, nothing: the run is over."""
        with self._lock:
            self._finished[seq] = entry
            while self._next in self._finished:
                done = self._finished.pop(self._next)
                self._next += 1
                if done is None or self._failed:
                    continue
                # Before the put: the consumer empties the list it takes (see Run._taken).
                self._failed = bool(done[1]) and isinstance(done[1][-1], Failure)
                self.out.put(done)


def leaf(exc: BaseException) -> BaseException:
    """The one real error inside (nested) exception groups, preferring asynchdf5's own."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = leaf(sub)
            if isinstance(found, DataLayerError):
                return found
    return exc
