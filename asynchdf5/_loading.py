"""The reader stage of the pipeline: chunks read into cache slots, overlapping, handed on in order.

A :class:`ChunkLoader` walks the epochs' chunk plans from ``start_epoch`` on. Streaming, it starts
each chunk's read as soon as a cache slot is free, even while the chunk before is still being
read, so the disk or the network is never idle between chunks; the :class:`~._read.Reader` does
the I/O in worker threads, and each chunk's serving order is drawn meanwhile. Whatever order the
reads finish in, the chunks (and an error, after the chunks read before it) go downstream in plan
order. A chunk's slot comes back through ``LoadedChunk.release`` once the pipeline is done with it
(a chunk served in place, to the reader: at the latest when the run ends).

Chunks smaller than a slot share one while they fit, one after the other in it (:class:`_Shared`):
an epoch's ramp (its first chunk's rows, in pieces) takes one slot, not one per piece, so the
chunk after the ramp is read meanwhile instead of waiting for the pieces to be served.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Protocol

import anyio
import anyio.to_thread
import numpy as np
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from anyio.streams.memory import MemoryObjectSendStream

from ._cache import Slot, fit_heaps
from ._gather import check_rows
from ._pages import free_arrays
from ._plan import ChunkPlan, EpochPlan
from ._ragged_tops import is_heap
from ._read import Reader
from ._specs import LoadedChunk
from ._stats import ReadStats, StageClock

__all__ = ["ChunkItem", "ChunkLoader"]

_log = logging.getLogger("asynchdf5")

#: What the loader hands downstream: a loaded chunk, or the error that ended reading.
#: An epoch with no chunk (the rest of an epoch resumed after its last batch) is its plan alone.
ChunkItem = tuple[EpochPlan, LoadedChunk] | EpochPlan | Exception


class Plans(Protocol):
    """Where the loader's plans come from (the layer's :class:`~._planner.Planner`)."""

    async def plan_soon(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` (made off the event loop)."""
        ...


class ChunkLoader:
    """Reads the chunks of every epoch from ``start_epoch`` on into ``slots`` (``None``: the
    reader serves rows in place, as many chunks at a time as it allows), for :meth:`run`."""

    def __init__(
        self,
        reader: Reader,
        slots: list[Slot] | None,
        plans: Plans,
        start_epoch: int,
        stats: ReadStats,
        *,
        stream: bool = False,
    ) -> None:
        self.reader = reader
        self.slots = slots
        self.plans = plans
        self.stream = stream
        self.start_epoch = start_epoch
        self.stats = stats
        #: Chunks served in place that the pipeline has not given back yet (see
        #: :meth:`give_back_all`).
        self._held: set[LoadedChunk] = set()

    async def run(self, send: ObjectSendStream[ChunkItem]) -> None:
        """Read the chunks of each epoch in order, and hand them to the batcher in order.

        Streaming, a chunk is read as soon as a cache slot is free, even while the chunk
        before it is still being read: the reads overlap, so the disk or the network is never
        idle between chunks (the round trip at a read's head and its stragglers at the tail are
        hidden behind the other read). The source serves requests first come first served, so
        the earlier chunk's requests go first. In place (no slots), as many chunks at a time as
        the reader allows (:attr:`~._read.Reader.reads_at_once`).
        """
        slots = self.slots
        free_send, free_recv = anyio.create_memory_object_stream[Slot](len(slots or ()) or 1)
        for s in slots or ():
            free_send.send_nowait(s)
        # One worker per slot reads the chunks given to it (in place: as many chunks at a time
        # as the reader allows). The workers start with the run, so no task is spawned per chunk.
        workers = len(slots or ()) or max(1, self.reader.reads_at_once)
        work_send, work_recv = anyio.create_memory_object_stream[_Work](workers)
        # The loads started, in chunk order; at most one per worker.
        loads_send, loads_recv = anyio.create_memory_object_stream[_Load](workers)
        # Idle, the reader waits for a free slot: blocked by the stages after it.
        busy = StageClock(self.stats.stage, blocked=True)
        async with (
            send,
            free_send,
            free_recv,
            work_send,
            work_recv,
            loads_send,
            loads_recv,
            anyio.create_task_group() as tg,
        ):
            for _ in range(workers):
                tg.start_soon(self._worker, work_recv, busy)
            tg.start_soon(self._launcher, loads_send, work_send, free_send, free_recv)
            async for load in loads_recv:
                await load.done.wait()
                # An error is queued behind the chunks already read, so that the batcher
                # cuts and sends their batches before it raises it.
                item = load.error if load.error is not None else load.item
                assert item is not None
                try:
                    await send.send(item)
                except anyio.BrokenResourceError:  # the batcher has ended
                    break
                if load.error is not None:
                    break
            tg.cancel_scope.cancel()  # the loads still running are of no use

    async def _launcher(
        self,
        loads: ObjectSendStream[_Load],
        work: ObjectSendStream[_Work],
        free_send: MemoryObjectSendStream[Slot],
        free_recv: ObjectReceiveStream[Slot],
    ) -> None:
        """Hand each chunk, in order, to a worker once a slot is free for it (or room in the slot
        the chunk before it was given: :class:`_Shared`)."""
        epoch = self.start_epoch
        shared: _Shared | None = None
        try:
            while True:
                plan = await self.plans.plan_soon(epoch, stream=self.stream)
                if not plan.chunks:  # nothing to read: the batcher ends the epoch
                    load = _Load()
                    load.item = plan
                    load.done.set()
                    await loads.send(load)
                for chunk in plan.chunks:
                    region = None
                    if self.slots is not None:
                        if shared is not None and not shared.fits(chunk.rows):
                            shared.close()  # before waiting for a slot: it may be the one
                            shared = None
                        if shared is None:
                            shared = _Shared(await free_recv.receive(), free_send)
                            if shared.one:  # its heaps hold this chunk's values: grown if not
                                old = fit_heaps(shared.slot, self.reader.tops, chunk.ranges)
                                if old:
                                    _log.debug(
                                        "epoch %d chunk %d: its values outgrew cache slot %d's "
                                        "heaps: grown to %d bytes",
                                        chunk.epoch,
                                        chunk.index,
                                        shared.slot.index,
                                        shared.slot.nbytes,
                                    )
                                    await anyio.to_thread.run_sync(free_arrays, old)
                        region = shared.take(chunk.rows)
                    load = _Load()
                    await work.send((load, plan, chunk, region))
                    await loads.send(load)
                epoch += 1
        finally:
            if shared is not None:
                shared.close()

    async def _worker(
        self,
        work: ObjectReceiveStream[_Work],
        busy: StageClock,
    ) -> None:
        async for load, plan, chunk, region in work:
            await self._run_load(load, plan, chunk, region, busy)

    async def _run_load(
        self,
        load: _Load,
        plan: EpochPlan,
        chunk: ChunkPlan,
        region: _Region | None,
        busy: StageClock,
    ) -> None:
        slot = None if region is None else region.slot
        t0 = time.perf_counter()
        busy.start()
        try:
            loaded = await self._load(chunk, slot)
        except Exception as exc:
            load.error = exc
        else:
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug(
                    "epoch %d chunk %d: %d samples in %d range(s) read in %.1f ms",
                    chunk.epoch,
                    chunk.index,
                    chunk.rows,
                    len(chunk.ranges),
                    (time.perf_counter() - t0) * 1e3,
                )
            if region is not None:
                loaded.on_release(region.release)
            elif loaded.rows_are_global:
                self._held.add(loaded)
                loaded.on_release(functools.partial(self._give_back, loaded))
                loaded.verify = self.reader.verify
                loaded.guard = self.reader.guard
            load.item = (plan, loaded)
        finally:
            busy.stop(blocked=True)
            load.done.set()

    def _give_back(self, loaded: LoadedChunk) -> None:
        self._held.discard(loaded)
        self.reader.release(loaded.plan)

    def give_back_all(self) -> None:
        """The run is over: give the reader back the chunks served in place that the pipeline
        did not finish with (the consumer left an epoch, a read failed): they will not be."""
        for loaded in list(self._held):
            loaded.on_release(None)
            self._give_back(loaded)

    async def _load(self, chunk: ChunkPlan, slot: Slot | None) -> LoadedChunk:
        """Read a chunk into ``slot`` (or in place), and draw its serving order (and the global
        indices of the samples in it) meanwhile."""
        drawn: list[tuple[np.ndarray | None, np.ndarray, bool]] = []
        where: list[Any] = [None]
        # Where the rows will be taken from: the reader's own arrays at global indices, or the
        # slot at the positions of the order (a region of a slot holding exactly the chunk's
        # rows: :class:`_Shared`). Checked here, once, off the event loop.
        in_place = self.reader.in_place
        target = self.reader.own_arrays if in_place else (None if slot is None else slot.arrays)

        async def read() -> None:
            where[0] = await self.reader.read(
                chunk, slot.arrays if slot is not None else None, self.stats
            )

        def draw() -> tuple[np.ndarray | None, np.ndarray, bool]:
            positions = chunk.order()
            indices = chunk.served_indices(positions)
            rows = indices if in_place else positions
            if target is None:
                return positions, indices, False
            if rows is not None:
                check_rows(rows, target)
            return positions, indices, True

        async def permute() -> None:
            drawn.append(await anyio.to_thread.run_sync(draw))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(permute)
                tg.start_soon(read)
        except BaseException:
            # The read may have finished (a reader's thread is waited for, even when the run is
            # cancelled) while the order failed or was cancelled: no LoadedChunk will carry the
            # rows it made ready in place, so nothing else would give them back.
            if where[0] is not None and where[0][1] and slot is None:
                self.reader.release(chunk)
            raise
        arrays, rows_are_global = where[0]
        ((positions, indices, checked),) = drawn
        # Checked against what the read returned, or the gather checks each batch itself.
        checked = checked and arrays is target and rows_are_global == in_place
        if rows_are_global:  # rows are taken at their global indices: positions are not needed
            positions = None
        return LoadedChunk(
            chunk, positions, arrays, indices, rows_are_global=rows_are_global, checked=checked
        )


class _Load:
    """One chunk's read, done by a worker; the reader hands them on in order."""

    __slots__ = ("done", "error", "item")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.item: tuple[EpochPlan, LoadedChunk] | EpochPlan | None = None
        self.error: Exception | None = None


class _Shared:
    """A cache slot that consecutive chunks share while they fit, each in the rows after the one
    before (chunks smaller than a slot: an epoch's ramp, a short last chunk). It goes back to the
    free slots once the launcher has closed it (the next chunk did not fit) and every chunk read
    into it has been released. Used on the event loop's thread only.

    A slot with ragged tops' heaps (:mod:`._ragged_tops`) holds one chunk (:attr:`one`): its
    heaps are sized for one chunk, and grown for one that holds more (:func:`~._cache.fit_heaps`,
    while the slot is free)."""

    __slots__ = ("_capacity", "_closed", "_free", "_used", "_users", "one", "slot")

    def __init__(self, slot: Slot, free: MemoryObjectSendStream[Slot]) -> None:
        self.slot = slot
        self._free = free
        self._capacity = min((len(a) for k, a in slot.arrays.items() if not is_heap(k)), default=0)
        self.one = any(is_heap(k) for k in slot.arrays)
        self._used = 0
        self._users = 0
        self._closed = False

    def fits(self, rows: int) -> bool:
        if self.one and self._used:
            return False
        return self._used + rows <= self._capacity

    def take(self, rows: int) -> _Region:
        """The next ``rows`` rows of the slot, for one chunk."""
        a = self._used
        self._used += rows
        self._users += 1
        arrays = {k: v if is_heap(k) else v[a : a + rows] for k, v in self.slot.arrays.items()}
        return _Region(Slot(self.slot.index, arrays), self)

    def close(self) -> None:
        """No more chunks go in."""
        self._closed = True
        self._give_back()

    def release(self) -> None:
        """A chunk read into it is done with."""
        self._users -= 1
        self._give_back()

    def _give_back(self) -> None:
        if self._closed and self._users == 0:
            self._users = -1  # once
            # After the run is over the stream is closed; the slot is free anyway.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._free.send_nowait(self.slot)


class _Region:
    """One chunk's rows of a :class:`_Shared` slot: ``slot`` (views), released once."""

    __slots__ = ("_shared", "slot")

    def __init__(self, slot: Slot, shared: _Shared) -> None:
        self.slot = slot
        self._shared: _Shared | None = shared

    def release(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()


#: A chunk for a worker to read: its load, its epoch's plan, the chunk, where to read it into.
_Work = tuple[_Load, EpochPlan, ChunkPlan, _Region | None]
