"""The pipeline: a reader and a batcher task, and the gathering threads, wired with bounded queues.

One :class:`Run` serves epochs from ``start_epoch`` on, in one *mode*: ``"epoch"`` (per-epoch
batch cuts, an :class:`EpochEnd` marker after each epoch) or ``"stream"`` (full batches that wrap
across epochs), its plans asked of the layer's planner (:class:`~._loading.Plans`). A run lives in
the layer's task group; the consumer (:mod:`._consumer`) starts it, replaces it when the consumer
leaves an epoch early or switches mode, and cancels it when the layer closes; the consumer's side
of the queue is :meth:`Run.take` and :meth:`Run.take_nowait`.

Data moves one way::

    reader ──(LoadedChunk)──▶ batcher ══(GroupSpec)══▶ gather threads ══(Batch group)══▶ consumer
     task      memory stream    task     queue.Queue   (long-lived)      Handoff    (take / ready)

The reader (a :class:`~._loading.ChunkLoader`) fills each cache slot with the next chunk as soon
as the slot is free, even while the chunk before is still being read, drawing each chunk's
serving order meanwhile, and hands the chunks on in order; the batcher cuts that order into
groups of batches; the gathering stage (:class:`~._gathering.Gatherers`) has the
:class:`~._delivery.Delivery` gather, transform (and upload) them, ahead of the consumer by a
bounded number of groups, and hands them over in the order they were cut; the consumer takes
each group's batches one at a time. The gather threads never wait for the event loop: they take
the next group from a thread-safe queue the batcher keeps filled, and put the result where the
consumer takes it without a loop round trip (:class:`~._handoff.Handoff`). A slot goes back to
the reader once every batch cut from it is gathered and taken. A failure in any stage is sent to
the consumer, after the batches that were complete before it, and ends the run.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
from anyio.abc import ObjectReceiveStream

from ._cache import Slot
from ._delivery import Delivery, line_offset
from ._gather import carry
from ._gathering import Entry, EpochEnd, Failure, Gatherers, GroupItem, Item
from ._gathering import leaf as _leaf
from ._loading import ChunkItem, ChunkLoader, Plans
from ._plan import EpochPlan
from ._read import Reader
from ._schemas import Schemas, run_at
from ._specs import BatchSpec, GroupSpec
from ._stats import Stats

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["EpochEnd", "Failure", "Item", "Mode", "Run"]

_log = logging.getLogger("asynchdf5")

Mode = Literal["epoch", "stream"]

#: A group (the batches gathered in one worker-thread call, and handed to the consumer as one
#: queue item) holds about this many bytes ...
GROUP_BYTES = 8 * 2**20
#: ... but a group takes at most this share of the cache's bytes (the ring holds about six
#: groups: with a cache sized to a small memory limit, 8 MiB groups would take more than the
#: cache) ...
GROUP_SHARE = 16
#: ... and at least this many bytes (per-group work stays small next to a batch's).
MIN_GROUP_BYTES = 2**20
#: The fewest groups of batch buffers a run holds: one ready for the consumer, one being
#: gathered by each of two workers, one queued behind them, and two the consumer may hold.
RING_GROUPS = 6


def group_bytes(cached: int) -> int:
    """The bytes of a group of batches next to a cache (or data in memory or mapped) of
    ``cached`` bytes (0: not known: :data:`GROUP_BYTES`)."""
    if cached <= 0:
        return GROUP_BYTES
    return min(GROUP_BYTES, max(MIN_GROUP_BYTES, cached // GROUP_SHARE))


#: ... and at most ``Delivery.group_batches`` batches.


class Run:
    """The background pipeline from ``start_epoch`` on, in one mode.

    **Nothing waits on itself.** The reader needs a free cache slot to read the next chunk, and
    a slot is freed when every row of its chunk has been cut and every batch cut from it has been
    gathered and taken by the consumer. The invariant that keeps this from ever waiting on a
    later chunk: *no incomplete batch holds a slot across a chunk boundary*. When the batcher
    has cut the last row of a chunk and the batch it is building is still short (chunks and
    batches need not line up: ramped first chunks, a short last chunk, a stream wrapping into
    the next epoch), it copies that batch's rows (fewer than ``batch_size``) into a carry buffer
    of their own and lets go of the chunk (:meth:`_carry`). So each batch holds at most one
    slot, and a slot comes back once the batches fully inside its chunk are gathered and taken,
    which depends only on the consumer taking batches, never on a chunk still to be read. Any
    number of slots >= 1 makes progress; two let the next chunk be read while this one is
    served.
    """

    def __init__(
        self,
        reader: Reader,
        slots: list[Slot] | None,
        plans: Plans,
        *,
        mode: Mode,
        start_epoch: int,
        batch_size: int,
        delivery: Delivery,
        prefetch: int,
        stats: Stats,
        gather_threads: int = 2,
        schemas: Schemas | None = None,
    ) -> None:
        self.slots = slots
        #: Streams of different schemas: no batch spans two (:mod:`._schemas`).
        self.schemas = schemas
        self._loader = ChunkLoader(
            reader, slots, plans, start_epoch, stats.read, stream=mode == "stream"
        )
        self.mode: Mode = mode
        self.batch_size = batch_size
        self.delivery = delivery
        self.stats = stats
        row_bytes = int(sum(t.mean_row_bytes for t in reader.tops.values()))
        sources = slots[0].arrays if slots else reader.own_arrays
        # Gather several batches per group: the batcher's and the consumer's Python work is per
        # group, not per batch, which matters at thousands of batches per second. Groups of
        # about GROUP_BYTES, or less next to a small cache (see group_bytes).
        # Mapped rows over several files or from stored chunks are no ndarray: their nbytes.
        cached = sum(s.nbytes for s in slots or ()) or sum(
            int(getattr(a, "nbytes", 0)) for a in (sources or {}).values()
        )
        per_group = group_bytes(cached)
        self.group = int(
            max(1, min(delivery.group_batches, per_group // max(1, row_bytes * batch_size)))
        )
        capacity = max(prefetch, self.group)
        groups = -(-capacity // self.group)  # gathered groups waiting for the consumer
        #: The gathering stage: worker threads, and the queue to the consumer.
        self._gatherers = Gatherers(delivery, stats.gather, gather_threads)
        workers = self._gatherers.workers
        # Groups cut and not yet taken by the consumer: `groups` ready, one being gathered by
        # each worker, one queued behind them (so a worker never waits for the batcher to wake).
        room = groups + workers + 1
        self._room = anyio.Semaphore(room)
        # Batch buffers: enough for the groups in flight and the group the consumer takes
        # batches from, reused once the consumer lets go of them.
        # Rows of several mapped files (``_read._maps.Spliced``) start at several offsets.
        offsets = {
            k: line_offset(a) for k, a in (sources or {}).items() if isinstance(a, np.ndarray)
        }
        # A batch of an epoch holds at most every sample; one of the endless stream is full.
        rows = batch_size if mode == "stream" else min(batch_size, reader.n_samples)
        delivery.start(reader.tops, rows * self.group, room + 2, offsets)
        self._out = self._gatherers.out
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self._row_specs = {
            t.name: (t.sample_shape, t.dtype) for t in reader.tops.values() if t.ragged is None
        }
        #: Ragged tops (name -> sparse), carried with their values (:func:`~._carry.carry`).
        self._ragged = {
            t.name: t.ragged.sparse for t in reader.tops.values() if t.ragged is not None
        }

    async def main(self) -> None:
        """Run until cancelled or failed; always ends the gathering threads and the consumer's
        queue."""
        self._gatherers.start()
        drain = False  # let the gather threads finish what is queued (a failure is behind it)
        try:
            with self.scope:
                send, recv = anyio.create_memory_object_stream[ChunkItem](
                    math.inf if self.slots is not None else 1
                )
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_upstream, self._loader.run, send)
                        await self._batcher(recv)
                    drain = True  # the batcher forwarded an error and ended
                except Exception as exc:  # every failure goes to the consumer, in order
                    self._gatherers.put(Failure(_leaf(exc)), False)
                    drain = True
                except BaseExceptionGroup as group:
                    # Errors beside a cancellation: a read failed while the run was being
                    # stopped (the consumer took an earlier failure, or left). Nobody waits for
                    # them any more; the cancellation goes on.
                    _, cancelled = group.split(Exception)
                    if cancelled is None:  # pragma: no cover - only Exceptions: caught above
                        raise
                    raise cancelled from None
                finally:
                    send.close()
                    recv.close()
        finally:
            self._gatherers.finish(drop=not drain or self.scope.cancel_called)
            with anyio.CancelScope(shield=True):  # quick: at most a group in progress each
                await anyio.to_thread.run_sync(self._gatherers.join)
            self._loader.give_back_all()  # nothing gathers from them any more
            self._out.finish()
            self.done.set()

    async def stop(self) -> None:
        """Cancel the run and wait until its tasks and threads are done."""
        self.scope.cancel()
        await self.done.wait()
        self.shut()

    # --- the consumer's side ------------------------------------------------------------------

    def take_nowait(self) -> list[Item]:
        """The items of the next gathered group (batches, epoch ends, a failure), without
        waiting: :class:`anyio.WouldBlock` when none is ready, :class:`anyio.EndOfStream` after
        the run ended, :class:`anyio.ClosedResourceError` after :meth:`shut`."""
        while True:
            items = self._taken(self._out.get_nowait())
            if items:
                return self._loose(items)

    async def take(self) -> list[Item]:
        """:meth:`take_nowait`, waiting for a group when none is ready."""
        while True:
            try:
                entry = await self._out.get(self._gatherers.poll)
            except anyio.WouldBlock:
                continue
            items = self._taken(entry)
            if items:
                return self._loose(items)

    def _loose(self, items: list[Item]) -> list[Item]:
        """``items``, and with them the batches handed over one by one that are ready behind
        them (with transformers: see :class:`~._gathering.Gatherers`). They hold no chunk and
        no room, so taking them early changes no bound; taken together, they cost the consumer
        one trip instead of one each."""
        out = self._out
        while (entry := out.peek()) is not None and entry[0] is None and not entry[2]:
            items += self._taken(out.get_nowait())
        return items

    def _taken(self, entry: Entry) -> list[Item]:
        """The consumer took ``entry``: its chunks' rows are no longer needed, and its room
        goes back to the batcher. Its items come out of the entry's list, which is left empty:
        a gather worker that has not yet dropped the entry then holds none of its batches, and
        each batch's buffers (host group, device blocks) come back as soon as it is dropped."""
        group, items, permit = entry
        if group is not None:
            for chunk, _, _ in group.pieces:
                chunk.let_go()
        if permit:
            self._room.release()
        taken = items.copy()
        items.clear()
        return taken

    def shut(self) -> None:
        """The consumer is gone: drop what is queued for it (event-loop thread)."""
        self._out.close()

    # --- the stages -----------------------------------------------------------------------------

    async def _submit(self, item: GroupItem) -> None:
        """Queue ``item`` for the gathering threads, once there is room for it."""
        await self._room.acquire()
        self._gatherers.put(item, True)

    async def _batcher(self, recv: ObjectReceiveStream[ChunkItem]) -> None:
        """Cut the chunks' serving orders into batches, in groups for the gatherer.

        Runs of whole batches within a chunk are cut at once (one piece, a size per batch); only
        a batch that straddles chunks (or, in a stream, epochs) is cut piece by piece, and
        carried out of its chunk when that chunk ends (the invariant: see the class docstring).
        """
        B = self.batch_size
        stream = self.mode == "stream"
        schemas = self.schemas
        group = GroupSpec()
        cur: BatchSpec | None = None
        full = 0  # whole batches left in the epoch (epoch mode)
        tail: collections.deque[int] = collections.deque()  # then these sizes
        need = 0  # the size of the batch being cut
        # The run's first group is one batch: the consumer waits for the first batch alone, not
        # for a group of them to be gathered into fresh buffers.
        limit = 1

        def mark(schema: int | None, k: int) -> None:
            """The group's next ``k`` batches are of ``schema`` (:mod:`._schemas`)."""
            assert schemas is not None and schema is not None
            tops = schemas.tops[schema]
            runs = group.schemas
            if runs is None:
                group.schemas = [(k, tops)]
            elif runs[-1][1] is tops:
                runs[-1] = (runs[-1][0] + k, tops)
            else:
                runs.append((k, tops))

        def next_size() -> int:
            nonlocal full
            if stream:
                return B
            if full:
                full -= 1
                return B
            return tail.popleft() if tail else 0

        async with recv:
            async for item in recv:
                if isinstance(item, Exception):
                    await self._submit(Failure(_leaf(item)))  # behind the groups already cut
                    return
                if isinstance(item, EpochPlan):  # an empty epoch
                    await self._submit(EpochEnd(item.epoch))
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
                runs = None
                if schemas is not None:  # where the serving order passes to another schema
                    runs = await anyio.to_thread.run_sync(schemas.runs, chunk.indices)
                end, schema = size, None
                while pos < size and need:
                    if runs is not None:
                        end, schema = run_at(runs, pos, size)
                    if cur is None and need == B and end - pos >= B:
                        # A run of whole batches: `need` is the first of them.
                        k = (end - pos) // B
                        room = max(1, limit - len(group.sizes))
                        k = min(k, room, k if stream else full + 1)
                        if schemas is not None:
                            mark(schema, k)
                        group.add(chunk, pos, pos + k * B)
                        group.sizes += [B] * k
                        group.epochs += [epoch] * k
                        pos += k * B
                        if not stream:
                            full -= k - 1
                        need = next_size()
                    else:
                        if cur is None:
                            cur = BatchSpec(epoch, schema=schema)
                        elif cur.schema != schema:
                            assert schemas is not None and cur.schema is not None
                            assert schema is not None
                            raise schemas.mixed(cur.schema, schema)
                        take = min(need - cur.rows, end - pos)
                        cur.pieces.append((chunk, pos, pos + take))
                        chunk.hold()
                        cur.rows += take
                        pos += take
                        if cur.rows < need:
                            continue
                        if schemas is not None:
                            mark(cur.schema, 1)
                        if cur.ends_epoch is not None:
                            group.ends[len(group.sizes)] = cur.ends_epoch
                        group.pieces += cur.pieces  # refs were taken as they were cut
                        group.sizes.append(need)
                        group.epochs.append(cur.epoch)
                        cur = None
                        need = next_size()
                    if len(group.sizes) >= limit:
                        await self._submit(group)
                        group, limit = GroupSpec(), self.group
                chunk.all_cut()  # its slot goes back once the last batch from it is let go of
                last = chunk.plan.index == len(plan.chunks) - 1
                if last and cur is not None:
                    cur.ends_epoch = plan.epoch  # stream mode: the batch wraps into the next epoch
                if group.sizes:
                    await self._submit(group)
                    group, limit = GroupSpec(), self.group
                if cur is not None:
                    await self._carry(cur)  # the invariant: see the class docstring
                if last and cur is None:
                    await self._submit(EpochEnd(plan.epoch))

    async def _carry(self, spec: BatchSpec) -> None:
        """Move the rows of the incomplete batch ``spec`` out of the chunks they are in, into a
        carry buffer of its own, and let go of those chunks."""
        held = spec.pieces
        specs = self._row_specs
        if spec.schema is not None and self.schemas is not None:
            specs = {k: specs[k] for k in self.schemas.tops[spec.schema].values()}
        ragged = self._ragged if spec.schema is None else {}  # (schemas: no ragged tops)
        carried = await anyio.to_thread.run_sync(carry, spec, specs, ragged)
        spec.pieces = [(carried, 0, spec.rows)]
        for chunk, _, _ in held:
            chunk.let_go()


async def _upstream(stage: Callable[..., Awaitable[None]], *args: Any) -> None:
    """Run a stage that feeds another; when the one downstream has ended (its stream closed),
    stop quietly: the downstream stage reports whatever ended it."""
    with contextlib.suppress(anyio.BrokenResourceError):
        await stage(*args)
