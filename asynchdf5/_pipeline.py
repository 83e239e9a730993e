"""The pipeline: reader and batcher tasks wired with bounded memory object streams.

One :class:`Run` serves epochs from ``start_epoch`` on, in one *mode*: ``"epoch"`` (per-epoch
batch cuts, an :class:`EpochEnd` marker after each epoch) or ``"stream"`` (full batches that wrap
across epochs). A run lives in the layer's task group; the layer replaces it when the consumer
leaves an epoch early or switches mode, and cancels it when the layer closes.

Data moves one way, through four tasks and bounded memory object streams::

    reader ──(LoadedChunk)──▶ batcher ──(BatchSpec group)──▶ gatherer ──(Batch group)──▶ sender
                                                                                          │
                                                      consumer ◀──(Batch | EpochEnd | Failure)

The reader (a :class:`~._loading.ChunkLoader`) fills each cache slot with the next chunk as soon
as the slot is free, even while the chunk before is still being read, drawing each chunk's
serving order meanwhile, and hands the chunks on in order; the batcher cuts that order into
batches; the gatherer has the :class:`~._delivery.Delivery` gather, transform (and upload) them
in groups in a worker thread, ahead of the consumer by up to ``prefetch`` batches; the sender
queues them for the consumer. A slot goes back to the reader once every batch cut
from it is gathered. A failure in any stage is sent to the consumer, after the batches that were
complete before it, and ends the run.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from ._batch import Batch, BatchSpec, GroupSpec, carry
from ._cache import Slot
from ._delivery import Delivery, line_offset
from ._errors import DataLayerError
from ._loading import ChunkItem, ChunkLoader
from ._plan import EpochPlan
from ._read import Reader
from ._stats import Stats

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["EpochEnd", "Failure", "Item", "Mode", "Run"]

_log = logging.getLogger("asynchdf5")

Mode = Literal["epoch", "stream"]

#: A group (the batches gathered in one worker-thread call, and handed to the consumer as one
#: queue item) holds about this many bytes ...
GROUP_BYTES = 8 * 2**20
#: ... and at most ``Delivery.group_batches`` batches.


@dataclass(frozen=True)
class EpochEnd:
    """Marker: every batch of ``epoch`` has been sent."""

    epoch: int


@dataclass(frozen=True)
class Failure:
    """The run failed with ``error``; nothing follows."""

    error: BaseException


Item = Batch | EpochEnd | Failure
#: What the batcher hands the gatherer, and the gatherer the sender; errors travel in order.
_GroupItem = GroupSpec | EpochEnd | Exception
_DoneItem = tuple[GroupSpec, list[Batch]] | EpochEnd | Exception


class Run:
    """The background pipeline from ``start_epoch`` on, in one mode.

    **Nothing waits on itself.** The reader needs a free cache slot to read the next chunk, and
    a slot is freed when every row of its chunk has been cut and every batch cut from it has been
    gathered. The invariant that keeps this from ever waiting on a later chunk: *no incomplete
    batch holds a slot across a chunk boundary*. When the batcher has cut the last row of a
    chunk and the batch it is building is still short (chunks and batches need not line up:
    ramped first chunks, a short last chunk, a stream wrapping into the next epoch), it copies
    that batch's rows (fewer than ``batch_size``) into a carry buffer of their own and lets go
    of the chunk (:meth:`_carry`). So each batch holds at most one slot, and a slot comes back
    once the batches fully inside its chunk are gathered, which depends only on the consumer
    taking batches, never on a chunk still to be read. Any number of slots >= 1 makes progress;
    two let the next chunk be read while this one is served.
    """

    def __init__(
        self,
        reader: Reader,
        slots: list[Slot] | None,
        plan: Callable[[int], EpochPlan],
        *,
        mode: Mode,
        start_epoch: int,
        batch_size: int,
        delivery: Delivery,
        prefetch: int,
        stats: Stats,
        gather_threads: int = 2,
    ) -> None:
        self.slots = slots
        self._loader = ChunkLoader(reader, slots, plan, start_epoch, stats.read)
        self.mode: Mode = mode
        self.batch_size = batch_size
        self.delivery = delivery
        self.stats = stats
        row_bytes = sum(t.row_bytes for t in reader.tops.values())
        # Gather several batches per worker-thread call: a thread hop costs tens of µs, which
        # matters at thousands of batches per second. Groups of about GROUP_BYTES.
        self.group = int(
            max(1, min(delivery.group_batches, GROUP_BYTES // max(1, row_bytes * batch_size)))
        )
        capacity = max(prefetch, self.group)
        groups = -(-capacity // self.group)  # the queue holds whole groups
        # Batch buffers: enough for what can be in flight (the queue, one group being gathered,
        # the group the consumer takes batches from), reused once the consumer lets go of them.
        sources = slots[0].arrays if slots else reader.own_arrays
        offsets = {k: line_offset(a) for k, a in (sources or {}).items()}
        delivery.start(reader.tops, batch_size * self.group, groups + 4, offsets)
        self._pool = ThreadPoolExecutor(1, "asynchdf5-gather") if gather_threads > 1 else None
        # Batches reach the consumer a group at a time (one list per gathered group, epoch markers
        # in order): a stream operation per batch costs more than a small batch's gathering.
        self._send, self.items = anyio.create_memory_object_stream[list[Item]](groups)
        #: The consumer's side of the current group: items taken from ``items``, not yet served.
        self.ready: collections.deque[Item] = collections.deque()
        #: Epoch at the head of ``items`` when the consumer stands at an epoch boundary, else None.
        self.head_epoch: int | None = start_epoch
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self._gather_limiter = anyio.CapacityLimiter(1)
        self._row_specs = {t.name: (t.sample_shape, t.dtype) for t in reader.tops.values()}

    async def main(self) -> None:
        """Run until cancelled or failed; always closes the item stream."""
        try:
            with self.scope:
                send, recv = anyio.create_memory_object_stream[ChunkItem](
                    math.inf if self.slots is not None else 1
                )
                groups_send, groups_recv = anyio.create_memory_object_stream[_GroupItem](1)
                done_send, done_recv = anyio.create_memory_object_stream[_DoneItem](1)
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_upstream, self._loader.run, send)
                        tg.start_soon(_upstream, self._batcher, recv, groups_send)
                        tg.start_soon(_upstream, self._gatherer, groups_recv, done_send)
                        await self._sender(done_recv)
                except Exception as exc:  # every failure goes to the consumer
                    await self._send.send([Failure(_leaf(exc))])
                finally:
                    for stream in (send, recv, groups_send, groups_recv, done_send, done_recv):
                        stream.close()
        finally:
            self._send.close()
            if self._pool is not None:
                with anyio.CancelScope(shield=True):  # the thread is idle: this is quick
                    await anyio.to_thread.run_sync(self._pool.shutdown)
            self.done.set()

    async def stop(self) -> None:
        """Cancel the run and wait until its tasks and threads are done."""
        self.scope.cancel()
        await self.done.wait()
        self.items.close()
        self.ready.clear()

    async def _batcher(
        self, recv: ObjectReceiveStream[ChunkItem], groups: ObjectSendStream[_GroupItem]
    ) -> None:
        """Cut the chunks' serving orders into batches, in groups for the gatherer.

        Runs of whole batches within a chunk are cut at once (one piece, a size per batch); only
        a batch that straddles chunks (or, in a stream, epochs) is cut piece by piece, and
        carried out of its chunk when that chunk ends (the invariant: see the class docstring).
        """
        B = self.batch_size
        stream = self.mode == "stream"
        group = GroupSpec()
        cur: BatchSpec | None = None
        full = 0  # whole batches left in the epoch (epoch mode)
        tail: collections.deque[int] = collections.deque()  # then these sizes
        need = 0  # the size of the batch being cut

        def next_size() -> int:
            nonlocal full
            if stream:
                return B
            if full:
                full -= 1
                return B
            return tail.popleft() if tail else 0

        async with recv, groups:
            async for item in recv:
                if isinstance(item, Exception):
                    await groups.send(item)  # behind the groups already cut
                    return
                if isinstance(item, EpochPlan):  # an empty epoch
                    await groups.send(EpochEnd(item.epoch))
                    continue
                plan, chunk = item
                epoch = chunk.plan.epoch
                if chunk.plan.index == 0 and not stream:
                    full, tail = plan.full_batches, collections.deque(plan.tail)
                    need = next_size()
                elif stream:
                    need = B
                size = chunk.size
                pos = 0
                while pos < size and need:
                    if cur is None and need == B and size - pos >= B:
                        # A run of whole batches: `need` is the first of them.
                        k = (size - pos) // B
                        room = max(1, self.group - len(group.sizes))
                        k = min(k, room, k if stream else full + 1)
                        group.add(chunk, pos, pos + k * B)
                        group.sizes += [B] * k
                        group.epochs += [epoch] * k
                        pos += k * B
                        if not stream:
                            full -= k - 1
                        need = next_size()
                    else:
                        if cur is None:
                            cur = BatchSpec(epoch)
                        take = min(need - cur.rows, size - pos)
                        cur.pieces.append((chunk, pos, pos + take))
                        chunk.refs += 1
                        cur.rows += take
                        pos += take
                        if cur.rows < need:
                            continue
                        if cur.ends_epoch is not None:
                            group.ends[len(group.sizes)] = cur.ends_epoch
                        group.pieces += cur.pieces  # refs were taken as they were cut
                        group.sizes.append(need)
                        group.epochs.append(cur.epoch)
                        cur = None
                        need = next_size()
                    if len(group.sizes) >= self.group:
                        await groups.send(group)
                        group = GroupSpec()
                chunk.cut = True
                last = chunk.plan.index == len(plan.chunks) - 1
                if last and cur is not None:
                    cur.ends_epoch = plan.epoch  # stream mode: the batch wraps into the next epoch
                if group.sizes:
                    await groups.send(group)
                    group = GroupSpec()
                if cur is not None:
                    await self._carry(cur)  # the invariant: see the class docstring
                chunk.done_with()
                if last and cur is None:
                    await groups.send(EpochEnd(plan.epoch))

    async def _carry(self, spec: BatchSpec) -> None:
        """Move the rows of the incomplete batch ``spec`` out of the chunks they are in, into a
        carry buffer of its own, and let go of those chunks."""
        held = spec.pieces
        carried = await anyio.to_thread.run_sync(carry, spec, self._row_specs)
        spec.pieces = [(carried, 0, spec.rows)]
        for chunk, _, _ in held:
            chunk.refs -= 1
            chunk.done_with()

    async def _gatherer(
        self, groups: ObjectReceiveStream[_GroupItem], done: ObjectSendStream[_DoneItem]
    ) -> None:
        """Gather and transform each group in a worker thread. It runs while the sender hands
        the previous group to the consumer, so the event loop's work and the gathering overlap."""
        times = self.stats.gather.stage
        clock = time.perf_counter
        async with groups, done:
            t0 = clock()
            async for item in groups:
                t1 = clock()
                times.starved += t1 - t0
                if not isinstance(item, GroupSpec):
                    await done.send(item)
                    if isinstance(item, Exception):
                        return
                    t0 = clock()
                    continue
                try:
                    batches, error = await anyio.to_thread.run_sync(
                        self.delivery.make,
                        item,
                        self.stats.gather,
                        self._pool,
                        limiter=self._gather_limiter,
                    )
                finally:
                    for chunk, _, _ in item.pieces:
                        chunk.refs -= 1
                        chunk.done_with()
                t2 = clock()
                await done.send((item, batches))
                t0 = clock()
                times.busy += t2 - t1
                times.blocked += t0 - t2
                if error is not None:
                    await done.send(error)  # after the complete batches before it
                    return

    async def _sender(self, done: ObjectReceiveStream[_DoneItem]) -> None:
        """Hand batches and epoch markers to the consumer, a group at a time, in order; raise a
        forwarded error."""
        send = self._send
        async with done:
            async for item in done:
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, EpochEnd):
                    await send.send([item])
                    continue
                spec, batches = item
                group: list[Item] = []
                for i, batch in enumerate(batches):  # fewer than spec.sizes on an error
                    group.append(batch)
                    if i in spec.ends:
                        group.append(EpochEnd(spec.ends[i]))
                if group:
                    await send.send(group)


async def _upstream(stage: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run a stage that feeds another; when the one downstream has ended (its stream closed),
    stop quietly: the downstream stage reports whatever ended it."""
    with contextlib.suppress(anyio.BrokenResourceError):
        await stage(*args)


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside (nested) exception groups, preferring asynchdf5's own."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            leaf = _leaf(sub)
            if isinstance(leaf, DataLayerError):
                return leaf
    return exc
