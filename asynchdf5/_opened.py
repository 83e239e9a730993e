"""What an open layer has (:class:`Opened`): its reader, its cache slots, the data's shape and
the task group its runs live in, from ``async with`` (or ``with``) to the end of the close.

:meth:`Opened.enter` is the last step of an opening: the source side of the layer (its catalog,
its reader and slots, the planner's checks) has built everything else before it, and hands it
here once; nothing of the opening is left to do after it returns but for the consumer to adopt
it. The layer's :class:`~._consumer.Consumer` holds one while the layer is open. Closing is
done in the task that opened it (the task group's rule), and releases everything even when
cancelled: the reader's files and threads, the delivery, and the cache's pages (in a worker
thread: giving back a large cache blocks for tens of milliseconds).
"""

from __future__ import annotations

from types import TracebackType

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal

from ._cache import Slot, free_slots
from ._delivery import Delivery
from ._errors import StateError
from ._process import ProcessReader
from ._read import Reader
from ._shape import DataShape
from ._thread_call import release_whole

__all__ = ["Opened"]


class Opened:
    """An opening of a layer: made by :meth:`enter` in the opening task, ended by :meth:`exit`
    and :meth:`release` in the same task. Its fields are fixed for the opening's life (the
    slots aside, dropped once released)."""

    def __init__(
        self,
        reader: Reader | ProcessReader,
        slots: list[Slot] | None,
        shape: DataShape,
        slot_rows: int,
        task_group: TaskGroup,
        *,
        portal: BlockingPortal | None,
        at: float,
    ) -> None:
        self.reader = reader
        #: The cache slots (None: rows are served in place).
        self.slots = slots
        #: The data's shape this opening serves.
        self.shape = shape
        #: The rows a cache slot holds (what a state loaded while open must fit).
        self.slot_rows = slot_rows
        self.task_group = task_group
        #: Opened with ``with``: the portal of the event loop in the background thread, through
        #: which a ``for`` loop takes its batches (None: opened with ``async with``).
        self.portal = portal
        #: When the opening began (``time.perf_counter()``): the first batch's latency runs
        #: from there.
        self.at = at
        self._opener = anyio.get_current_task().id

    @classmethod
    async def enter(
        cls,
        reader: Reader | ProcessReader,
        slots: list[Slot] | None,
        shape: DataShape,
        *,
        slot_rows: int,
        delivery: Delivery,
        portal: BlockingPortal | None,
        at: float,
    ) -> Opened:
        """The opening, complete: ``delivery`` checked against the reader's tops (a
        :class:`~asynchdf5.SchemaError` before any batch; in a worker thread, as the check may
        import what batches are made of) and the task group entered in the
        calling task. On failure the reader is closed here: it is this opening's."""
        try:
            await anyio.to_thread.run_sync(delivery.check, reader.tops)
            task_group = anyio.create_task_group()
            await task_group.__aenter__()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await reader.aclose()
            raise
        return cls(reader, slots, shape, slot_rows, task_group, portal=portal, at=at)

    def check_closer(self) -> None:
        """:class:`StateError` unless the calling task opened the layer."""
        if anyio.get_current_task().id != self._opener:
            raise StateError("close the layer in the task that opened it")

    async def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Wait for the task group (its run cancelled by the caller); whatever left the body
        goes on unchanged (None: the body's exception, if any, is re-raised).

        The body's exception is never handed to the task group. The group's scope is never
        cancelled by the layer, so no cancellation leaving the body is the group's own: handed
        to it, a cancellation from outside (asyncio's runner cancels its main task on Ctrl-C)
        could be taken for the group's and swallowed, so that ``async with`` ended as if its
        body had finished (on asyncio, when it came beside a cancellation of an inner scope of
        anyio's); and any other exception would come out wrapped in an ExceptionGroup. The
        group only has to wait for the cancelled run. A cancellation that comes during that
        wait still propagates out of it.
        """
        await self.task_group.__aexit__(None, None, None)

    async def release(self, delivery: Delivery) -> None:
        """Release the reader's files and threads, ``delivery`` and the cache (the run ended)."""
        try:
            await self.reader.aclose()
        finally:
            delivery.close()
            slots, self.slots = self.slots, None
            if slots:
                with anyio.CancelScope(shield=True):
                    await release_whole(free_slots, slots)
