"""Batches from DataLoader workers to the main process through reused shared memory.

PyTorch sends a worker's tensors by moving each into *fresh* shared memory (``share_memory_``)
and pickling a handle to it: a new allocation, first-touched, per tensor, per batch. Here a
worker keeps a small ring of slots of shared memory (:class:`~asynchdf5._process.Segment`, the
helper-process mode's), copies each batch into a free slot (warm memory, one copy) and yields a
:class:`SharedBatch`, which pickles as the slot's name (the ring's and the slot's number) and
the batch's layout. Unpickled in the main process it *is* the batch: a dict of tensors viewing
the slot, which is marked free (a flag byte at the slot's end, written by the main process only
when it frees, by the worker only when it fills) once the last of those tensors, or of any view
of them, is gone. A worker finding no slot free (the training loop keeps many batches alive)
yields plain tensors instead, as before: nothing waits.

The slot's descriptor travels only with the first batch of the slot (``multiprocessing``'s
``DupFd``, as torch's own tensors travel: a connection to the worker per descriptor, far
dearer than the batch's message), as the helper-process mode passes a slot's descriptor with
the message that first uses it. The main process keeps each slot mapped (:data:`_MAPPED`) and
rebuilds the later batches of that slot from its mapping: a worker's messages reach the main
process in the order it sent them, so the descriptor is always there first. The mappings of a
worker that has ended are dropped when a new ring first sends (its slots free no memory before:
the main process's mappings hold it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from .._batch import Batch
from .._process import Segment, needed, write_batch

#: The most slots a worker makes: the DataLoader's batches in flight (``prefetch_factor``, 2 by
#: default, which a worker cannot see), the one the loop holds, one being pinned, and room. A
#: slot is made only when every one made is in use, so a worker makes about
#: ``prefetch_factor + 1``, and one with ``prefetch_factor`` up to about 12 still finds one free.
SLOTS = 16

#: A ring's name: its worker's process id, and a number of its own (process ids are reused).
Token = tuple[int, int]

#: In the main process: the slots mapped, by ring and slot number, with each slot's generation
#: (a slot grown for a larger batch is a new segment, sent again).
_MAPPED: dict[tuple[Token, int], tuple[int, Segment]] = {}
_MAPPING = threading.Lock()


class SharedBatch:
    """A batch written into a slot: pickles as the slot and rebuilds as a dict of tensors."""

    def __init__(
        self,
        token: Token,
        index: int,
        generation: int,
        fd: int | None,
        size: int,
        layout: Any,
        indices: str | None,
    ) -> None:
        self.token, self.index, self.generation = token, index, generation
        self.fd, self.size, self.layout, self.indices = fd, size, layout, indices

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        dup = DupFd(self.fd) if self.fd is not None else None
        slot = (self.token, self.index, self.generation)
        return _rebuild, (slot, dup, self.size, self.layout, self.indices)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a process of another user has the pid
        return True
    return True


def _map(token: Token, index: int, generation: int, dup: Any, size: int) -> Segment:
    """The main process's mapping of a slot: made from the descriptor sent with the slot's
    first batch, kept for the later ones."""
    key = (token, index)
    if dup is None:
        kept = _MAPPED.get(key)
        if kept is None or kept[0] != generation:
            raise RuntimeError(  # a worker's messages arrive in order: never expected
                f"asynchdf5.torch: a batch of slot {index} of DataLoader worker process "
                f"{token[0]} came before the slot's memory"
            )
        return kept[1]
    fd = dup.detach()
    try:
        segment = Segment(fd, size)
    finally:
        os.close(fd)
    with _MAPPING:  # loaders with pin_memory unpickle in threads of their own
        keys = list(_MAPPED)
        if all(t != token for t, _ in keys):  # a new ring: forget the slots of ended workers
            for gone in [k for k in keys if not _alive(k[0][0])]:
                del _MAPPED[gone]
        _MAPPED[key] = (generation, segment)
    return segment


def _rebuild(
    slot: tuple[Token, int, int], dup: Any, size: int, layout: Any, indices: str | None
) -> dict[str, torch.Tensor]:
    segment = _map(*slot, dup, size)
    owner = segment.owner

    def release() -> None:
        owner[-1] = 0  # the worker may fill this slot again

    arrays, index = segment.views(layout, release)
    out = {name: torch.from_numpy(a) for name, a in arrays.items()}
    if indices is not None:
        out[indices] = torch.from_numpy(index)
    return out


@dataclass
class _Slot:
    segment: Segment
    fd: int
    generation: int
    sent: bool = False  # its descriptor went with a batch


class Ring:
    """A worker's slots, made as batches need them (each sized for the batch that first
    fills it, grown for a larger one)."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._token: Token = (os.getpid(), int.from_bytes(os.urandom(8), "little"))

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
        for i, slot in enumerate(self._slots):
            if slot.segment.owner[-1] == 0:
                if slot.segment.size < size:
                    os.close(slot.fd)
                    segment, fd = Segment.create(size)
                    slot = self._slots[i] = _Slot(segment, fd, slot.generation + 1)
                return self._fill(i, slot, data, batch.indices, indices)
        if len(self._slots) < SLOTS:
            segment, fd = Segment.create(size)
            self._slots.append(_Slot(segment, fd, 0))
            return self._fill(len(self._slots) - 1, self._slots[-1], data, batch.indices, indices)
        return None

    def _fill(
        self,
        i: int,
        slot: _Slot,
        data: Mapping[str, np.ndarray],
        index: np.ndarray,
        indices: str | None,
    ) -> SharedBatch:
        layout = write_batch(slot.segment, data, index)
        slot.segment.owner[-1] = 1  # the main process frees it
        fd = None if slot.sent else slot.fd
        slot.sent = True
        return SharedBatch(self._token, i, slot.generation, fd, slot.segment.size, layout, indices)

    def close(self) -> None:
        """Close the descriptors (the memory goes with the last mapping)."""
        slots, self._slots = self._slots, []
        for slot in slots:
            os.close(slot.fd)
