"""What an open layer has (:class:`Opened`): its reader, its cache slots and the task group its
runs live in (:meth:`Opened.start_run` starts one there), from ``async with`` (or ``with``) to
the end of the close.

The layer's :class:`~._consumer.Consumer` holds one while the layer is open. Closing is done in
the task that opened it (the task group's rule), and releases everything even when cancelled:
the reader's files and threads, the delivery, and the cache's pages (in a worker thread: giving
back a large cache blocks for tens of milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from ._batch import Batch
from ._cache import Slot, free_slots
from ._delivery import Delivery
from ._errors import StateError
from ._pipeline import Mode, Run
from ._planner import Planner
from ._process import ProcessReader
from ._read import Reader
from ._schemas import Schemas
from ._stats import Stats

if TYPE_CHECKING:
    from ._iterator import EpochIterator

__all__ = ["Bridge", "Opened"]

#: How a ``for`` loop iterates an iterator of a layer opened with ``with`` (the sync bridge).
Bridge = Callable[["EpochIterator"], Iterator[Batch]]


class Opened:
    """An opening of a layer: made by :meth:`enter` in the opening task, ended by :meth:`exit`
    and :meth:`release` in the same task."""

    def __init__(
        self,
        reader: Reader | ProcessReader,
        slots: list[Slot] | None,
        task_group: TaskGroup,
        *,
        sync: bool,
        bridge: Bridge | None,
        at: float,
    ) -> None:
        self.reader = reader
        #: The cache slots (None: rows are served in place).
        self.slots = slots
        self.task_group = task_group
        #: Opened with ``with``: iterated through the sync bridge only.
        self.sync = sync
        self.bridge = bridge
        #: When the opening began (``time.perf_counter()``): the first batch's latency runs
        #: from there.
        self.at = at
        self._opener = anyio.get_current_task().id

    @classmethod
    async def enter(
        cls,
        reader: Reader | ProcessReader,
        slots: list[Slot] | None,
        *,
        sync: bool,
        bridge: Bridge | None,
        at: float,
    ) -> Opened:
        """Open: the task group is entered in the calling task."""
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        return cls(reader, slots, task_group, sync=sync, bridge=bridge, at=at)

    def start_run(
        self,
        mode: Mode,
        epoch: int,
        planner: Planner,
        *,
        batch_size: int,
        delivery: Delivery,
        prefetch: int,
        stats: Stats,
    ) -> Run:
        """A run serving ``mode`` from ``epoch`` over this opening's reader and slots, started
        in its task group (``process=True``: a run the helper process serves)."""
        run: Run
        reader = self.reader
        schemas = Schemas.of(planner.shape.streams) if planner.shape is not None else None
        if isinstance(reader, ProcessReader):
            run = reader.new_run(mode, epoch)
        else:
            run = Run(
                reader,
                self.slots,
                planner,
                mode=mode,
                start_epoch=epoch,
                batch_size=batch_size,
                delivery=delivery,
                prefetch=prefetch,
                stats=stats,
                schemas=schemas,
            )
        self.task_group.start_soon(run.main)
        return run

    def check_closer(self) -> None:
        """:class:`StateError` unless the calling task opened the layer."""
        if anyio.get_current_task().id != self._opener:
            raise StateError("close the layer in the task that opened it")

    async def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Wait for the task group (its run cancelled); what its exit returns."""
        if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
            return await self.task_group.__aexit__(exc_type, exc, tb)
        # Any other exception leaving the body is the caller's own: handed to the task group,
        # it would come out wrapped in an ExceptionGroup. The group only has to wait for the
        # cancelled run; returning None re-raises the exception unchanged.
        await self.task_group.__aexit__(None, None, None)
        return None

    async def release(self, delivery: Delivery) -> None:
        """Release the reader's files and threads, ``delivery`` and the cache (the run ended)."""
        try:
            await self.reader.aclose()
        finally:
            delivery.close()
            slots, self.slots = self.slots, None
            if slots:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(free_slots, slots)
