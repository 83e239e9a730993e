"""Batches from DataLoader workers to the main process through reused shared memory.

PyTorch sends a worker's tensors by moving each into *fresh* shared memory (``share_memory_``)
and pickling a handle to it: a new allocation, first-touched, per tensor, per batch. Here a
worker keeps a small ring of slots of shared memory (:class:`~asynchdf5._process.Segment`, the
helper-process mode's), copies each batch into a free slot (warm memory, one copy) and yields a
:class:`SharedBatch`, which pickles as the slot's descriptor (``multiprocessing``'s ``DupFd``,
as torch's own tensors travel) and its layout. Unpickled in the main process it *is* the batch:
a dict of tensors viewing the slot, which is marked free (a flag byte at the slot's end, written
by the main process only when it frees, by the worker only when it fills) once the last of
those tensors, or of any view of them, is gone. A worker finding no slot free (the training
loop keeps many batches alive) yields plain tensors instead, as before: nothing waits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from .._batch import Batch
from .._process import Segment, needed, write_batch

#: Slots per worker: the DataLoader's batches in flight (``prefetch_factor``, 2 by default),
#: the one the loop holds, one being pinned, and room.
SLOTS = 6


class SharedBatch:
    """A batch written into a slot: pickles as the slot and rebuilds as a dict of tensors."""

    def __init__(self, segment: Segment, fd: int, layout: Any, indices: str | None) -> None:
        self.segment, self.fd, self.layout, self.indices = segment, fd, layout, indices

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (DupFd(self.fd), self.segment.size, self.layout, self.indices)


def _rebuild(dup: Any, size: int, layout: Any, indices: str | None) -> dict[str, torch.Tensor]:
    fd = dup.detach()
    try:
        segment = Segment(fd, size)
    finally:
        os.close(fd)
    owner = segment.owner

    def release() -> None:
        owner[-1] = 0  # the worker may fill this slot again

    arrays, index = segment.views(layout, release)
    out = {name: torch.from_numpy(a) for name, a in arrays.items()}
    if indices is not None:
        out[indices] = torch.from_numpy(index)
    return out


class Ring:
    """A worker's slots, made as batches need them (each sized for the batch that first
    fills it, grown for a larger one)."""

    def __init__(self) -> None:
        self._slots: list[tuple[Segment, int]] = []

    def pack(self, batch: Batch, indices: str | None) -> SharedBatch | None:
        """``batch`` copied into a free slot; None where it cannot be (no slot free, arrays
        that are not plain host arrays, several streams): then the caller sends tensors."""
        if batch.streams is not None:
            return None
        data: dict[str, np.ndarray] = {}
        for name, array in batch.items():
            if type(array) is not np.ndarray or array.dtype.hasobject:
                return None
            data[name] = array
        rows = len(batch.indices)
        size = needed(data, rows) + 1  # the flag byte last
        for i, (segment, fd) in enumerate(self._slots):
            if segment.owner[-1] == 0:
                if segment.size < size:
                    os.close(fd)
                    segment, fd = Segment.create(size)
                    self._slots[i] = (segment, fd)
                return self._fill(segment, fd, data, batch.indices, indices)
        if len(self._slots) < SLOTS:
            segment, fd = Segment.create(size)
            self._slots.append((segment, fd))
            return self._fill(segment, fd, data, batch.indices, indices)
        return None

    def _fill(
        self,
        segment: Segment,
        fd: int,
        data: Mapping[str, np.ndarray],
        index: np.ndarray,
        indices: str | None,
    ) -> SharedBatch:
        layout = write_batch(segment, data, index)
        segment.owner[-1] = 1  # the main process frees it
        return SharedBatch(segment, fd, layout, indices)

    def close(self) -> None:
        """Close the descriptors (the memory goes with the last mapping)."""
        slots, self._slots = self._slots, []
        for _, fd in slots:
            os.close(fd)
