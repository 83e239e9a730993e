"""The runs of ``process=True`` on the layer's side: what the consumer takes batches from.

A :class:`RemoteRun` has the consumer's side of a :class:`~asynchdf5._pipeline.Run` and nothing
else: its batches come from the helper through the layer's
:class:`~asynchdf5._process._parent.ProcessReader`, so the consumer, the iterator and the sync
bridge work unchanged. With a device, an :class:`Uploader` has the layer's own delivery upload
each host batch the helper gathered. Kept apart from the reader, which owns the helper process
and its slots; a run only asks it for items.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import TYPE_CHECKING

import anyio
import numpy as np

from .._batch import Batch
from .._catalog import TopInfo
from .._gathering import Failure, Item
from .._ragged_tops import heap_keys
from .._specs import Carry, GroupSpec
from .._stats import GatherStats
from .._thread_call import run_sync_whole

if TYPE_CHECKING:
    from .._delivery import Delivery
    from .._pipeline import Mode
    from .._pipeline import Run as RunBase
    from ._parent import ProcessReader
else:
    # At run time a RemoteRun is no Run (nothing of the pipeline runs here): the type checker
    # sees the interface the consumer uses.
    RunBase = object

__all__ = ["RemoteRun", "Uploader"]


class Uploader:
    """``device=...`` with ``process=True``: the helper gathers host batches (without the
    transformers), and the layer's own delivery uploads each one from its slot, and runs the
    transformers on the device, in a worker thread of the layer's process."""

    def __init__(self, delivery: Delivery, tops: Mapping[str, TopInfo], rows: int, depth: int):
        self.delivery = delivery
        self.stats = GatherStats()  # the layer's process's own part, added to the helper's
        #: The ragged tops (name -> whether sparse): carried as a chunk holds them.
        self._ragged = {k: t.ragged.sparse for k, t in tops.items() if t.ragged is not None}
        delivery.start(tops, rows, depth)

    def upload(self, items: list[Item]) -> list[Item]:
        """``items`` with each host batch replaced by the delivery's (blocking)."""
        out: list[Item] = []
        for item in items:
            if not isinstance(item, Batch):
                out.append(item)
                continue
            carried = Carry(self._carried(item), item.indices)
            group = GroupSpec([(carried, 0, item.size)], [item.size], [item.epoch])
            made, error = self.delivery.make(group, self.stats, None)
            out += made
            if error is not None:
                out.append(Failure(error))
                break
        return out

    def _carried(self, batch: Batch) -> dict[str, np.ndarray]:
        """``batch``'s arrays as a :class:`~.._specs.Carry` holds them, for the delivery to
        gather from: a ragged top's (a Ragged, a sparse top's CSR matrix) as its rows' spans
        (int64 ``(rows, 2)``) over its heaps (values, and column indices), as a cache slot
        holds it (:func:`~.._ragged_tops.heap_keys`)."""
        arrays = dict(batch)
        for name, sparse in self._ragged.items():
            value = arrays[name]
            if sparse:
                offsets, heaps = value.indptr, [value.data, value.indices]
            else:
                offsets, heaps = value.offsets, [value.values]
            offsets = np.asarray(offsets, np.int64)
            arrays[name] = np.stack([offsets[:-1], offsets[1:]], axis=1)
            arrays.update(zip(heap_keys(name, sparse), heaps, strict=True))
        return arrays


class RemoteRun(RunBase):
    """The consumer's side of a run served by the helper process (see the module docstring):
    what :class:`~asynchdf5._pipeline.Run` offers the consumer, nothing else."""

    def __init__(  # no super().__init__: nothing of the pipeline runs here
        self,
        reader: ProcessReader,
        mode: Mode,
        start_epoch: int,
        token: int,
        uploader: Uploader | None = None,
    ) -> None:
        self._reader = reader
        self._uploader = uploader
        self._token = token
        self.mode = mode
        self.ready: collections.deque[Item] = collections.deque()
        self.head_epoch = start_epoch
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self._shut = False

    async def main(self) -> None:
        """Live until cancelled (the helper does the work)."""
        try:
            with self.scope:
                await anyio.sleep_forever()
        finally:
            self.done.set()

    async def stop(self) -> None:
        """Cancel the run and wait until it is done."""
        self.scope.cancel()
        await self.done.wait()
        self.shut()

    def take_nowait(self) -> list[Item]:
        if self._shut:
            raise anyio.ClosedResourceError
        if self._uploader is not None:
            raise anyio.WouldBlock  # an upload runs in a worker thread: take() does it
        return self._reader.take_nowait(self._token)

    async def take(self) -> list[Item]:
        if self._shut:
            raise anyio.ClosedResourceError
        items = await self._reader.take(self._token)
        if self._uploader is not None:
            # Waited for whole: the layer's delivery, which it uploads with, is closed once
            # a cancelled consumer leaves.
            items = await run_sync_whole(self._uploader.upload, items)
        return items

    def shut(self) -> None:
        self._shut = True
        self.ready.clear()
